"""Launch templates: typed knobs, sandboxed rendering, and revisions made by typed patches.

A template is a directory holding `template.toml` (name, dialect, knobs, env, sbatch options,
free variables, checkpoint layout) and a Jinja2 sbatch script. Rendering runs in a sandbox with
undefined names as errors, and a finalizer that refuses any string not proven shell-safe: a
job name or a path reaches the script only through the `sh` filter or pre-quoted fragments.

A patch is a typed change of knobs, never a text edit. Applying one to a revision gives a new
revision that names its parent and carries its rendered script and the unified diff. Revisions
are plain values; `RevisionDir` keeps them as JSON files under the template's `revisions/`
(the daemon's database is the other home of the same values).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import shlex
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import StrictUndefined
from jinja2 import TemplateError as JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.dialects import get_dialect
from daemon.dialects.base import Dialect, KnobError, KnobKind, Knobs, KnobValue

TEMPLATE_FILE = "template.toml"
REVISIONS_DIR = "revisions"
_MAX_SCRIPT_BYTES = 1_000_000

_SAFE_WORD = re.compile(r"^[A-Za-z0-9_./:=@%+,-]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]{0,63}$")
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:=@%/+\[\]-]{1,1024}$")
_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# sbatch options the knobs own: a template may not set them directly.
_KNOB_OWNED_OPTIONS = frozenset({"nodes", "gres", "gpus-per-node", "exclude"})


class TemplateError(ValueError):
    """A template that cannot be loaded, rendered or patched, with the reason."""


class ShellSafe(str):
    """A string already quoted for bash (or proven to need no quoting)."""

    __slots__ = ()


def shell_quote(value: object) -> ShellSafe:
    """The `sh` filter: one shell word, whatever the value holds."""
    if isinstance(value, ShellSafe):
        return value
    if isinstance(value, bool | int):
        return ShellSafe(str(value).lower() if isinstance(value, bool) else str(value))
    if not isinstance(value, str):
        raise TemplateError(f"cannot shell-quote {type(value).__name__} {value!r}")
    return ShellSafe(shlex.quote(value))


def shell_join(values: Iterable[object]) -> ShellSafe:
    """The `shjoin` filter: a list of words, each quoted."""
    if isinstance(values, str):
        raise TemplateError("shjoin takes a list of words, not a string")
    return ShellSafe(" ".join(shell_quote(value) for value in values))


def _finalize(value: object) -> object:
    """Let only proven-safe text into the script: anything else must pass through `sh`."""
    if isinstance(value, ShellSafe):
        return value
    if isinstance(value, bool | int):
        return shell_quote(value)
    if isinstance(value, str) and _SAFE_WORD.match(value):
        return value
    raise TemplateError(f"unquoted value {value!r} would reach the script: use `| sh`")


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        undefined=StrictUndefined,
        finalize=_finalize,
        autoescape=False,
        keep_trailing_newline=True,
    )
    environment.filters["sh"] = shell_quote
    environment.filters["shjoin"] = shell_join
    return environment


VarValue = str | tuple[str, ...]


@dataclass(frozen=True)
class LaunchTemplate:
    """A loaded template: its dialect, its current knobs and everything rendering needs."""

    name: str
    dialect: Dialect
    script_source: str
    knobs: Mapping[str, KnobValue]
    sbatch: tuple[tuple[str, str], ...] = ()
    variables: tuple[tuple[str, VarValue], ...] = ()
    config_base: Mapping[str, object] = field(default_factory=dict)
    checkpoint: CheckpointSpec | None = None
    directory: Path | None = None


def validate_knobs(dialect: Dialect, raw: Mapping[str, object]) -> dict[str, KnobValue]:
    """Type- and range-check every knob, fill none in silently, and check the invariant."""
    unknown = sorted(set(raw) - {spec.name for spec in dialect.knobs})
    if unknown:
        raise KnobError(f"dialect {dialect.name} has no knob(s) {', '.join(unknown)}")
    missing = [spec.name for spec in dialect.knobs if spec.name not in raw]
    if missing:
        raise KnobError(f"missing knob(s) {', '.join(missing)} for dialect {dialect.name}")
    knobs = {spec.name: spec.validate(raw[spec.name]) for spec in dialect.knobs}
    dialect.geometry(knobs)
    return knobs


def parse_template(
    document: Mapping[str, object], script_source: str, directory: Path | None = None
) -> LaunchTemplate:
    """Build a template from its parsed TOML document and its Jinja2 script text."""
    name = _required_str(document, "name")
    dialect = get_dialect(_required_str(document, "dialect"))
    knobs_raw = dict(_table(document, "knobs"))
    if "env" in knobs_raw:
        raise TemplateError("put environment variables in the [env] table, not under [knobs]")
    knobs_raw["env"] = dict(_table(document, "env"))
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
        config_base=dict(_table(document, "config_base")),
        checkpoint=checkpoint,
        directory=directory,
    )
    render(template)
    return template


def load_template(directory: Path) -> LaunchTemplate:
    """Load `template.toml` and the script it names from a template directory."""
    toml_path = directory / TEMPLATE_FILE
    try:
        document = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise TemplateError(f"cannot read {toml_path}: {error}") from error
    script_name = _required_str(document, "script")
    script_path = directory / script_name
    if Path(script_name).is_absolute() or ".." in Path(script_name).parts:
        raise TemplateError(f"script {script_name!r} must be a file inside {directory}")
    try:
        raw = script_path.read_bytes()
    except OSError as error:
        raise TemplateError(f"cannot read {script_path}: {error.strerror}") from error
    if len(raw) > _MAX_SCRIPT_BYTES or b"\0" in raw:
        raise TemplateError(f"{script_path} is not a script (binary or over 1 MB)")
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TemplateError(f"{script_path} is not UTF-8: {error}") from error
    return parse_template(document, source, directory)


def render(template: LaunchTemplate, knobs: Knobs | None = None) -> str:
    """The sbatch script for these knobs (the template's own when None)."""
    values = template.knobs if knobs is None else knobs
    dialect = template.dialect
    try:
        context = {
            "sbatch_header": _sbatch_header(template, values),
            "env_exports": _env_exports(dialect, values),
            "train_args": shell_join(dialect.render_args(values)),
            "config_json": ShellSafe(dialect.render_config(values, template.config_base) or ""),
            "knobs": dict(values),
            "vars": dict(template.variables),
            "name": template.name,
        }
        return _environment().from_string(template.script_source).render(context)
    except (JinjaTemplateError, KnobError) as error:
        raise TemplateError(f"template {template.name}: {error}") from error


def _sbatch_header(template: LaunchTemplate, knobs: Knobs) -> ShellSafe:
    nodes, gpus, exclude = knobs["nodes"], knobs["gpus_per_node"], knobs["exclude"]
    lines = [f"#SBATCH --nodes={nodes}", f"#SBATCH --gres=gpu:{gpus}"]
    if isinstance(exclude, tuple) and exclude:
        lines.append(f"#SBATCH --exclude={','.join(str(node) for node in exclude)}")
    lines += [f"#SBATCH --{key}={value}" for key, value in template.sbatch]
    return ShellSafe("\n".join(lines))


def _env_exports(dialect: Dialect, knobs: Knobs) -> ShellSafe:
    env = knobs["env"]
    pairs = [(str(pair[0]), str(pair[1])) for pair in _pairs(env)]
    pairs += list(dialect.render_env(knobs))
    return ShellSafe("\n".join(f"export {key}={shell_quote(value)}" for key, value in pairs))


def _pairs(value: KnobValue) -> list[tuple[str, str]]:
    if not isinstance(value, tuple):
        return []
    return [(str(pair[0]), str(pair[1])) for pair in value if isinstance(pair, tuple)]


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
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _SBATCH_VALUE.match(text):
        raise TemplateError(
            f"[sbatch] {key} = {value!r}: only letters, digits and _.,:=@%/+[]- are allowed"
        )
    return key, text


def _variable(key: str, value: object) -> tuple[str, VarValue]:
    if not _VAR_NAME.match(key):
        raise TemplateError(f"[vars] {key!r} is not a valid variable name")
    if isinstance(value, str):
        return key, value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return key, tuple(value)
    raise TemplateError(f"[vars] {key} must be a string or a list of strings")


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


# ---------------------------------------------------------------- patches and revisions


@dataclass(frozen=True)
class KnobChange:
    """One knob's move; `before` guards against applying a patch to a config it was not made for."""

    knob: str
    before: KnobValue
    after: KnobValue


@dataclass(frozen=True)
class Patch:
    """A typed change of knobs, with the reason that goes into the revision's record."""

    changes: tuple[KnobChange, ...]
    reason: str

    def apply(self, dialect: Dialect, knobs: Knobs) -> dict[str, KnobValue]:
        """The knobs after this patch, validated, invariant checked; refuses a no-op."""
        result = dict(knobs)
        for change in self.changes:
            if change.knob not in result:
                raise TemplateError(f"patch names unknown knob {change.knob!r}")
            if result[change.knob] != change.before:
                raise TemplateError(
                    f"patch expects {change.knob}={change.before!r} but the revision has "
                    f"{result[change.knob]!r}"
                )
            result[change.knob] = change.after
        if result == dict(knobs):
            raise TemplateError("patch changes nothing: refusing to relaunch the same config")
        try:
            return validate_knobs(dialect, result)
        except KnobError as error:
            raise TemplateError(f"patch breaks the template: {error}") from error

    def describe(self) -> str:
        return ", ".join(
            f"{change.knob}: {_show(change.before)} -> {_show(change.after)}"
            for change in self.changes
        )


def _show(value: KnobValue) -> str:
    if isinstance(value, tuple):
        if value and isinstance(value[0], tuple):
            return "{" + ", ".join(f"{pair[0]}={pair[1]}" for pair in value) + "}"
        return "[" + ", ".join(str(item) for item in value) + "]"
    return repr(value)


@dataclass(frozen=True)
class TemplateRevision:
    """One rendered, immutable state of a template; `parent` is None for the first one."""

    id: str
    template: str
    parent: str | None
    knobs: Mapping[str, KnobValue]
    script: str
    diff: str
    patch: Patch | None


def _revision_id(parent: str | None, knobs: Knobs, script: str) -> str:
    payload = json.dumps(
        {"parent": parent, "knobs": knobs_to_json(knobs), "script": script}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def initial_revision(template: LaunchTemplate) -> TemplateRevision:
    script = render(template)
    return TemplateRevision(
        id=_revision_id(None, template.knobs, script),
        template=template.name,
        parent=None,
        knobs=dict(template.knobs),
        script=script,
        diff="",
        patch=None,
    )


def apply_patch(
    template: LaunchTemplate, parent: TemplateRevision, patch: Patch
) -> TemplateRevision:
    """A new revision: the parent's knobs moved by the patch, rendered, diffed with the parent."""
    knobs = patch.apply(template.dialect, parent.knobs)
    script = render(template, knobs)
    revision_id = _revision_id(parent.id, knobs, script)
    diff = "".join(
        difflib.unified_diff(
            parent.script.splitlines(keepends=True),
            script.splitlines(keepends=True),
            fromfile=f"{template.name}@{parent.id}",
            tofile=f"{template.name}@{revision_id}",
        )
    )
    return TemplateRevision(revision_id, template.name, parent.id, knobs, script, diff, patch)


def diff_revisions(first: TemplateRevision, second: TemplateRevision) -> str:
    return "".join(
        difflib.unified_diff(
            first.script.splitlines(keepends=True),
            second.script.splitlines(keepends=True),
            fromfile=f"{first.template}@{first.id}",
            tofile=f"{second.template}@{second.id}",
        )
    )


def knobs_to_json(knobs: Knobs) -> dict[str, object]:
    """Knobs as JSON-able values: env maps as objects, lists as arrays."""
    result: dict[str, object] = {}
    for name, value in knobs.items():
        if isinstance(value, tuple) and value and isinstance(value[0], tuple):
            result[name] = {str(pair[0]): str(pair[1]) for pair in value if isinstance(pair, tuple)}
        elif isinstance(value, tuple):
            result[name] = list(value)
        else:
            result[name] = value
    return result


def knobs_from_json(dialect: Dialect, data: Mapping[str, object]) -> dict[str, KnobValue]:
    return validate_knobs(dialect, data)


def revision_to_json(revision: TemplateRevision) -> dict[str, object]:
    patch = None
    if revision.patch is not None:
        patch = {
            "reason": revision.patch.reason,
            "changes": [
                {
                    "knob": change.knob,
                    **knobs_to_json({"before": change.before, "after": change.after}),
                }
                for change in revision.patch.changes
            ],
        }
    return {
        "id": revision.id,
        "template": revision.template,
        "parent": revision.parent,
        "knobs": knobs_to_json(revision.knobs),
        "script": revision.script,
        "diff": revision.diff,
        "patch": patch,
    }


def revision_from_json(dialect: Dialect, data: Mapping[str, object]) -> TemplateRevision:
    """Read a stored revision back, re-validating every knob; raises TemplateError when damaged."""
    try:
        knobs_data = data["knobs"]
        if not isinstance(knobs_data, Mapping):
            raise TemplateError("knobs is not an object")
        knobs = knobs_from_json(dialect, knobs_data)
        patch = None
        patch_data = data.get("patch")
        if isinstance(patch_data, Mapping):
            changes = []
            for item in patch_data["changes"]:
                spec = dialect.spec(item["knob"])
                changes.append(
                    KnobChange(
                        item["knob"], spec.validate(item["before"]), spec.validate(item["after"])
                    )
                )
            patch = Patch(tuple(changes), str(patch_data["reason"]))
        fields = [data["id"], data["template"], data["script"], data["diff"]]
        if not all(isinstance(value, str) for value in fields):
            raise TemplateError("id, template, script and diff must be strings")
        parent = data.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise TemplateError("parent must be a string or null")
        return TemplateRevision(
            id=str(data["id"]),
            template=str(data["template"]),
            parent=parent,
            knobs=knobs,
            script=str(data["script"]),
            diff=str(data["diff"]),
            patch=patch,
        )
    except (KeyError, TypeError, KnobError) as error:
        raise TemplateError(f"damaged revision record: {error!r}") from error


class RevisionDir:
    """Revisions kept as `<template>/revisions/<id>.json`: the CLI's simple on-disk home."""

    def __init__(self, template: LaunchTemplate) -> None:
        if template.directory is None:
            raise TemplateError("an in-memory template has no revisions directory")
        self._template = template
        self.path = template.directory / REVISIONS_DIR

    def save(self, revision: TemplateRevision) -> Path:
        self.path.mkdir(exist_ok=True)
        target = self.path / f"{revision.id}.json"
        temporary = target.with_suffix(".tmp")
        temporary.write_text(json.dumps(revision_to_json(revision), indent=2) + "\n")
        temporary.replace(target)
        return target

    def load(self, revision_id: str) -> TemplateRevision:
        if not re.fullmatch(r"[0-9a-f]{4,64}", revision_id):
            raise TemplateError(f"{revision_id!r} is not a revision id")
        matches = sorted(self.path.glob(f"{revision_id}*.json")) if self.path.is_dir() else []
        if len(matches) != 1:
            found = "no" if not matches else "several"
            raise TemplateError(f"{found} revision(s) match {revision_id!r} in {self.path}")
        try:
            data = json.loads(matches[0].read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TemplateError(f"cannot read {matches[0]}: {error}") from error
        return revision_from_json(self._template.dialect, data)

    def all(self) -> list[TemplateRevision]:
        if not self.path.is_dir():
            return []
        return [self.load(path.stem) for path in sorted(self.path.glob("*.json"))]

    def head(self) -> TemplateRevision:
        """The newest revision: the one no other revision names as parent (the first if none)."""
        revisions = self.all()
        if not revisions:
            first = initial_revision(self._template)
            self.save(first)
            return first
        parents = {revision.parent for revision in revisions}
        leaves = [revision for revision in revisions if revision.id not in parents]
        if len(leaves) != 1:
            raise TemplateError(f"revisions in {self.path} branch: {[r.id for r in leaves]}")
        return leaves[0]


# ---------------------------------------------------------------- writing templates


def toml_value(value: object) -> str:
    """A TOML literal for the simple values templates hold (JSON strings are TOML strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return (
            "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
        )
    raise TemplateError(f"cannot write {type(value).__name__} to TOML")


def template_toml(
    *,
    name: str,
    dialect: str,
    script: str,
    knobs: Knobs,
    sbatch: Sequence[tuple[str, str]],
    variables: Sequence[tuple[str, VarValue]],
    config_base: Mapping[str, object],
    checkpoint: CheckpointSpec | None,
) -> str:
    """The text of a `template.toml` holding these values."""
    lines = [f"name = {toml_value(name)}", f"dialect = {toml_value(dialect)}"]
    lines += [f"script = {toml_value(script)}", "", "[knobs]"]
    lines += [
        f"{key} = {toml_value(value)}"
        for key, value in knobs_to_json(knobs).items()
        if key != "env"
    ]
    lines += ["", "[env]"]
    env = knobs.get("env", ())
    if isinstance(env, tuple):
        lines += [f"{pair[0]} = {toml_value(pair[1])}" for pair in env if isinstance(pair, tuple)]
    lines += ["", "[sbatch]"] + [f"{key} = {toml_value(value)}" for key, value in sbatch]
    lines += ["", "[vars]"] + [f"{key} = {toml_value(value)}" for key, value in variables]
    if config_base:
        lines += ["", "[config_base]"]
        lines += [f"{json.dumps(key)} = {toml_value(value)}" for key, value in config_base.items()]
    if checkpoint is not None:
        lines += ["", "[checkpoint]", f"layout = {toml_value(checkpoint.layout.value)}"]
        lines += [f"root = {toml_value(checkpoint.root)}"]
        if checkpoint.glob:
            lines += [f"glob = {toml_value(checkpoint.glob)}"]
        if checkpoint.marker:
            lines += [f"marker = {toml_value(checkpoint.marker)}"]
    return "\n".join(lines) + "\n"


def parse_knob_text(dialect: Dialect, knob: str, text: str) -> KnobValue:
    """A knob value typed on a command line or found in a script, checked against its spec."""
    spec = dialect.spec(knob)
    value: object
    if spec.kind is KnobKind.INT:
        try:
            value = int(text)
        except ValueError:
            raise KnobError(f"{knob}: {text!r} is not an integer") from None
    elif spec.kind is KnobKind.BOOL:
        lowered = text.lower()
        if lowered not in {"true", "false", "1", "0", "yes", "no"}:
            raise KnobError(f"{knob}: {text!r} is not true or false")
        value = lowered in {"true", "1", "yes"}
    elif spec.kind in (KnobKind.NAMES, KnobKind.NODES):
        value = [item for item in re.split(r"[,\s]+", text) if item]
    elif spec.kind is KnobKind.ENV:
        raise KnobError(f"{knob}: set environment variables one by one")
    else:
        value = text
    return spec.validate(value)
