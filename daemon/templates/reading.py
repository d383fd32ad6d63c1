"""`template.toml` and its script read into a `LaunchTemplate`, every field checked.

The directory is read as its owner by the daemon (`OwnerFiles.read_template`) and as the caller
by the CLI, through the same walk and caps; a template is rendered once on reading, so a broken
one is refused here rather than at its first relaunch.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.dialects import get_dialect
from daemon.dialects.base import Dialect, KnobError
from daemon.imported import (
    CHECKPOINT_KEY,
    CONFIGS_TABLE,
    ELSEWHERE_TABLE,
    IMPORTED_KEY,
    KNOB_NAMES_TABLE,
    ConfigCopy,
    SpliceError,
    checkpoint_of,
    copy_name_ok,
)
from daemon.imported_reading import read_imported
from daemon.importer import ImporterError, Knob
from daemon.owner_files import OwnerFiles, OwnerReadRefused, TemplateTexts
from daemon.owner_serve import TEMPLATE_FILE
from daemon.templates.model import (
    LaunchTemplate,
    TemplateError,
    VarValue,
    invariant_known,
    validate_knobs,
)
from daemon.templates.rendering import render

MAX_NAME_CHARS = 256
MAX_VAR_CHARS = 65_536
MAX_VAR_ITEMS = 1_024
MAX_CONFIG_BASE_CHARS = 256 * 1024
MAX_CONFIG_BASE_DEPTH = 32

_SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]{0,63}\Z")
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\[\]-]{1,1024}\Z")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
# sbatch options the knobs own: a template may not set them directly.
_KNOB_OWNED_OPTIONS = frozenset({"nodes", "gres", "gpus-per-node", "exclude"})


def parse_template(
    document: Mapping[str, object],
    script_source: str,
    directory: Path | None = None,
    configs: Mapping[str, str] | None = None,
) -> LaunchTemplate:
    """Build a template from its parsed TOML document and its Jinja2 script text (and, for an
    imported one, the texts of the configs it keeps: file in the directory -> text)."""
    name = _required_str(document, "name")
    if len(name) > MAX_NAME_CHARS:
        raise TemplateError(f"template name longer than {MAX_NAME_CHARS} characters")
    dialect = get_dialect(_required_str(document, "dialect"))
    if document.get(IMPORTED_KEY) is True:
        kept = _config_copies(name, _table(document, CONFIGS_TABLE), configs or {})
        return _parse_imported(document, name, dialect, script_source, directory, configs=kept)
    knobs_raw = dict(_table(document, "knobs"))
    if "env" in knobs_raw:
        raise TemplateError("put environment variables in the [env] table, not under [knobs]")
    knobs_raw["env"] = dict(_table(document, "env"))
    for spec in dialect.knobs:
        if spec.unset is not None:
            knobs_raw.setdefault(spec.name, spec.unset)  # an optional knob left out is unset
    try:
        knobs = validate_knobs(dialect, knobs_raw)
    except KnobError as error:
        raise TemplateError(f"template {name}: {error}") from error
    sbatch = tuple(_sbatch_option(key, value) for key, value in _table(document, "sbatch").items())
    variables = tuple(_variable(key, value) for key, value in _table(document, "vars").items())
    checkpoint = _checkpoint_spec(document.get("checkpoint"))
    template = LaunchTemplate(
        name=name,
        dialect=dialect,
        script_source=script_source,
        knobs=knobs,
        sbatch=sbatch,
        variables=variables,
        config_base=_config_base(_table(document, "config_base")),
        checkpoint=checkpoint,
        directory=directory,
    )
    render(template)
    return template


def _parse_imported(
    document: Mapping[str, object],
    name: str,
    dialect: Dialect,
    script_source: str,
    directory: Path | None,
    *,
    configs: tuple[ConfigCopy, ...],
) -> LaunchTemplate:
    """An imported template: the script is analysed again, with the configs it keeps; the TOML
    adds only the owner's flag mapping, knobs recorded at import as living in other files, the
    kept configs and a checkpoint dir."""
    extra = sorted(set(document) - _IMPORTED_KEYS)
    if extra:
        raise TemplateError(
            f"template {name}: an imported template takes its knobs from its script; "
            f"{', '.join(extra)} not allowed in template.toml"
        )
    try:
        knob_names = {
            str(flag): Knob(str(knob)) for flag, knob in _table(document, KNOB_NAMES_TABLE).items()
        }
        elsewhere = {
            Knob(str(knob)): str(why) for knob, why in _table(document, ELSEWHERE_TABLE).items()
        }
    except ValueError as error:
        raise TemplateError(f"template {name}: {error}") from error
    checkpoint_dir = document.get(CHECKPOINT_KEY)
    if checkpoint_dir is not None and (
        not isinstance(checkpoint_dir, str) or not checkpoint_dir.startswith("/")
    ):
        raise TemplateError(f"template {name}: {CHECKPOINT_KEY} must be an absolute path")
    try:
        imported = read_imported(
            dialect,
            script_source,
            file=str(document["script"]),
            knob_names=knob_names,
            elsewhere=elsewhere,
            checkpoint_dir=checkpoint_dir,
            configs=configs,
        )
        invariant = invariant_known(dialect, imported.not_managed)
        knobs = validate_knobs(dialect, imported.values, invariant=invariant)
    except (SpliceError, ImporterError, KnobError) as error:
        raise TemplateError(f"template {name}: {error}") from error
    return LaunchTemplate(
        name=name,
        dialect=dialect,
        script_source=script_source,
        knobs=knobs,
        checkpoint=checkpoint_of(dialect, imported),
        directory=directory,
        imported=imported,
    )


def _config_copies(
    name: str, table: Mapping[str, object], texts: Mapping[str, str]
) -> tuple[ConfigCopy, ...]:
    """`[configs]` (the path the script names -> the kept file) joined with the files' texts."""
    copies = []
    for path, copy in table.items():
        if not isinstance(copy, str) or not copy_name_ok(copy):
            raise TemplateError(f"template {name}: [configs] {path!r}: not a configs/<name> file")
        if copy not in texts:
            raise TemplateError(f"template {name}: the config copy {copy} was not read")
        copies.append(ConfigCopy(path, copy, texts[copy]))
    return tuple(copies)


_IMPORTED_KEYS = frozenset(
    {
        "name",
        "dialect",
        "script",
        IMPORTED_KEY,
        CHECKPOINT_KEY,
        KNOB_NAMES_TABLE,
        ELSEWHERE_TABLE,
        CONFIGS_TABLE,
    }
)
TemplateReader = Callable[[str], TemplateTexts]


def load_template(directory: Path, read: TemplateReader | None = None) -> LaunchTemplate:
    """Load `template.toml` and the script it names from a template directory.

    `read` reads the directory with its owner's rights (the daemon passes the owner's
    `OwnerFiles.read_template`); by default this process reads it as itself, through the
    same walk and caps. A refused read is a `TemplateError` that says why.
    """
    reader = read if read is not None else OwnerFiles.as_caller().read_template
    try:
        texts = reader(str(directory))
    except OwnerReadRefused as error:
        refusal = error.refusal
        raise TemplateError(
            f"template {directory} not read as {refusal.owner}: {refusal.kind}: {refusal.reason}"
        ) from error
    return template_from_texts(texts, directory)


def template_from_texts(texts: TemplateTexts, directory: Path) -> LaunchTemplate:
    """A template from the texts its owner's reader returned."""
    try:
        document = tomllib.loads(texts.toml_text)
    except (tomllib.TOMLDecodeError, RecursionError) as error:
        raise TemplateError(f"cannot read {directory / TEMPLATE_FILE}: {error}") from error
    return parse_template(document, texts.script_text, directory, dict(texts.configs))


def _required_str(document: Mapping[str, object], key: str) -> str:
    value = document.get(key)
    if not isinstance(value, str) or not value:
        raise TemplateError(f"template.toml needs a non-empty string `{key}`")
    return value


def _table(document: Mapping[str, object], key: str) -> Mapping[str, object]:
    value = document.get(key, {})
    if not isinstance(value, Mapping):
        raise TemplateError(f"[{key}] must be a table")
    return value


def _sbatch_option(key: str, value: object) -> tuple[str, str]:
    if not _SBATCH_KEY.match(key):
        raise TemplateError(f"[sbatch] {key!r} is not an sbatch long option name")
    if key in _KNOB_OWNED_OPTIONS:
        raise TemplateError(f"[sbatch] {key} is set by the knobs (nodes, gpus_per_node, exclude)")
    if value is True:
        return key, ""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _SBATCH_VALUE.match(text):
        raise TemplateError(
            f"[sbatch] {key} = {value!r}: only letters, digits and _.,:=@%/+[]- are allowed"
        )
    return key, text


def _variable(key: str, value: object) -> tuple[str, VarValue]:
    if not _VAR_NAME.match(key):
        raise TemplateError(f"[vars] {key!r} is not a valid variable name")
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(item, str) for item in items):
        raise TemplateError(f"[vars] {key} must be a string or a list of strings")
    if len(items) > MAX_VAR_ITEMS or any(len(str(item)) > MAX_VAR_CHARS for item in items):
        raise TemplateError(
            f"[vars] {key}: at most {MAX_VAR_ITEMS} items of {MAX_VAR_CHARS} characters"
        )
    return key, tuple(str(item) for item in items) if isinstance(value, list) else str(value)


def _config_base(table: Mapping[str, object]) -> dict[str, object]:
    """The base of a rendered config: plain JSON, bounded in size and depth (it is written into
    every revision's script)."""
    stack: list[tuple[object, int]] = [(table, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_BASE_DEPTH:
            raise TemplateError(f"[config_base] nested deeper than {MAX_CONFIG_BASE_DEPTH}")
        if isinstance(value, Mapping):
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
    if len(json.dumps(table, default=str)) > MAX_CONFIG_BASE_CHARS:
        raise TemplateError(f"[config_base] is over {MAX_CONFIG_BASE_CHARS} characters as JSON")
    return dict(table)


def _checkpoint_spec(value: object) -> CheckpointSpec | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TemplateError("[checkpoint] must be a table")
    try:
        layout = CheckpointLayout(str(value.get("layout")))
    except ValueError:
        choices = ", ".join(layout.value for layout in CheckpointLayout)
        raise TemplateError(f"[checkpoint] layout must be one of {choices}") from None
    root, glob, marker = value.get("root"), value.get("glob", ""), value.get("marker", "")
    if not isinstance(root, str) or not root or not isinstance(glob, str):
        raise TemplateError("[checkpoint] needs a string `root` (and `glob` is a string)")
    if not isinstance(marker, str):
        raise TemplateError("[checkpoint] marker must be a string")
    return CheckpointSpec(layout=layout, root=root, glob=glob, marker=marker)
