"""Launch templates: typed knobs, sandboxed rendering, and revisions made by typed patches.

One module over 500 lines for now, not for want of seams (the Jinja sandbox, the TOML reading,
the revisions below "patches and revisions") but because the relaunch and first-submission
code, reworked beside this split, imports each of them by name: the revisions move out first,
together with those imports.

A template is a directory holding `template.toml` (name, dialect, knobs, env, sbatch options,
free variables, checkpoint layout) and a Jinja2 sbatch script, or, for a template imported from
an existing script (`imported = true`), that script verbatim and copies of the config files it
names (`[configs]`, under `configs/`): its knobs are read from them, and a render splices
changed values where the script writes them, a config's through a patched copy the script
writes (`daemon.imported`). The directory is the user's: the daemon reads it as its owner
through `daemon.owner_files` (regular files inside the directory, 1 MB each at most), the CLI as
the caller, through the same walk.

Rendering runs in a sandbox with undefined names as errors, and a finalizer that refuses any
string not proven shell-safe: a job name or a path reaches the script only through the `sh`
filter or pre-quoted fragments. The script is the user's text run by root, so its Jinja is held
to a whitelist of constructs, checked on the parsed tree before anything runs: output
(`{{ expr }}`), names, attributes and items, constants, the `sh`/`shjoin` filters, the
`defined`/`none` tests, `if`/`elif`/`else`, comparisons, `and`/`or`/`not` and a short `~`.
Loops, macros, call blocks, include/import/extends, `set`, arithmetic and function calls are
refused with the line that holds them. A whitelist rather than budgets: the shipped templates
use nothing else, and without loops, calls or arithmetic the work and the
output of a render are linear in the source and the (capped) values, so nothing is left to
time out; the output cap and the deadline stay as a second line. Every failure, whatever Python
raises inside Jinja, is a `TemplateError`.

A patch is a typed change of knobs, never a text edit. Applying one to a revision gives a new
revision that names its parent and carries its rendered script and the unified diff. Revisions
are plain values; `RevisionDir` keeps them as JSON files under the template's `revisions/`
(the daemon's database is the other home of the same values).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
import shlex
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from jinja2 import StrictUndefined, Template, Undefined, nodes
from jinja2 import TemplateError as JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.checkpoints import Checkpoint, CheckpointLayout, CheckpointSpec
from daemon.dialects import get_dialect
from daemon.dialects.base import Dialect, KnobError, KnobKind, Knobs, KnobValue, Role
from daemon.imported import (
    CHECKPOINT_KEY,
    CONFIGS_TABLE,
    ELSEWHERE_TABLE,
    IMPORTED_KEY,
    KNOB_NAMES_TABLE,
    ConfigCopy,
    ImportedScript,
    SpliceError,
    checkpoint_of,
    copy_name_ok,
    invariant_terms,
)
from daemon.imported_reading import read_imported
from daemon.imported_render import splice
from daemon.importer import ImporterError, Knob
from daemon.owner_files import OwnerFiles, OwnerReadRefused, TemplateTexts
from daemon.owner_serve import MAX_TEMPLATE_FILE_BYTES, TEMPLATE_FILE

REVISIONS_DIR = "revisions"
_MAX_SCRIPT_BYTES = MAX_TEMPLATE_FILE_BYTES
MAX_RENDERED_CHARS = 2_000_000  # a real script is a few KB
RENDER_DEADLINE_S = 10.0  # a second line: without loops a render takes milliseconds
MAX_JINJA_TAGS = 2_000  # `{{` and `{%` in the source, counted before parsing
MAX_TEMPLATE_NODES = 10_000  # the shipped templates have under 100
MAX_TEMPLATE_DEPTH = 50
MAX_CONCAT_OPERANDS = 4  # `a ~ b` repeats values: keep the product small
MAX_NAME_CHARS = 256
MAX_VAR_CHARS = 65_536
MAX_VAR_ITEMS = 1_024
MAX_CONFIG_BASE_CHARS = 256 * 1024
MAX_CONFIG_BASE_DEPTH = 32

# Used with `.match` and ended by \Z: `$` would let a trailing newline into the script.
_SAFE_WORD = re.compile(r"[A-Za-z0-9_./:=@%+,-]*\Z")
_SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]{0,63}\Z")
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\[\]-]{1,1024}\Z")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
# sbatch options the knobs own: a template may not set them directly.
_KNOB_OWNED_OPTIONS = frozenset({"nodes", "gres", "gpus-per-node", "exclude"})
_EVERY_KNOB_MANAGED: Mapping[str, str] = MappingProxyType({})


class TemplateError(ValueError):
    """A template that cannot be loaded, rendered or patched, with the reason."""


class ShellSafe(str):
    """A string already quoted for bash (or proven to need no quoting)."""

    __slots__ = ()


def shell_quote(value: object) -> ShellSafe:
    """The `sh` filter: one shell word, whatever the value holds."""
    if isinstance(value, Undefined):
        str(value)  # StrictUndefined raises here, naming the missing variable
    if isinstance(value, ShellSafe):
        return value
    if isinstance(value, bool | int):
        return ShellSafe(str(value).lower() if isinstance(value, bool) else str(value))
    if not isinstance(value, str):
        raise TemplateError(f"cannot shell-quote {type(value).__name__} {value!r}")
    return ShellSafe(shlex.quote(value))


def shell_join(values: Iterable[object]) -> ShellSafe:
    """The `shjoin` filter: a list of words, each quoted."""
    if isinstance(values, Undefined):
        str(values)
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


_FILTERS: dict[str, Callable[..., object]] = {"sh": shell_quote, "shjoin": shell_join}
_TESTS = frozenset({"defined", "undefined", "none"})
# The constructs a launch template may use; anything else is refused at parse time.
_ALLOWED_NODES: tuple[type[nodes.Node], ...] = (
    nodes.Template,
    nodes.Output,
    nodes.TemplateData,
    nodes.Name,
    nodes.Getattr,
    nodes.Getitem,
    nodes.Const,
    nodes.Filter,
    nodes.Test,
    nodes.If,
    nodes.CondExpr,
    nodes.Compare,
    nodes.Operand,
    nodes.And,
    nodes.Or,
    nodes.Not,
    nodes.Concat,
)
_CONSTRUCTS = {
    "For": "a `for` loop",
    "Macro": "a macro",
    "CallBlock": "a `call` block",
    "Call": "a function or method call",
    "Include": "`include`",
    "Import": "`import`",
    "FromImport": "`from ... import`",
    "Extends": "`extends`",
    "Block": "a `block`",
    "Assign": "`set`",
    "AssignBlock": "`set`",
    "With": "`with`",
    "FilterBlock": "a `filter` block",
    "Pow": "arithmetic (`**`)",
    "Mul": "arithmetic (`*`)",
    "Div": "arithmetic (`/`)",
    "FloorDiv": "arithmetic (`//`)",
    "Mod": "arithmetic (`%`)",
    "Add": "arithmetic (`+`)",
    "Sub": "arithmetic (`-`)",
    "Neg": "arithmetic (unary `-`)",
    "Pos": "arithmetic (unary `+`)",
    "Slice": "a slice",
    "List": "a list literal",
    "Tuple": "a tuple literal",
    "Dict": "a dict literal",
}


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        undefined=StrictUndefined,
        finalize=_finalize,
        autoescape=False,
        keep_trailing_newline=True,
    )
    environment.globals.clear()  # no range(), lipsum(), cycler(), namespace(), dict()
    environment.filters = dict(_FILTERS)
    return environment


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> Template:
    """Compiling is most of a render's cost; a daemon renders the same few sources again.
    Only a source that passed the construct whitelist is compiled (and cached)."""
    if len(source) > _MAX_SCRIPT_BYTES:
        raise TemplateError("the script is over 1 MB")
    tags = source.count("{{") + source.count("{%")
    if tags > MAX_JINJA_TAGS:
        raise TemplateError(f"{tags} Jinja tags: more than {MAX_JINJA_TAGS}")
    environment = _environment()
    try:
        tree = environment.parse(source)
    except JinjaTemplateError as error:
        line = getattr(error, "lineno", None)
        raise TemplateError(f"line {line}: {error}" if line else str(error)) from error
    except RecursionError as error:
        raise TemplateError("the script's Jinja is nested too deeply") from error
    _check_constructs(tree)
    return environment.from_string(tree)


def _check_constructs(tree: nodes.Template) -> None:
    """Refuse any Jinja construct outside the whitelist, naming it and its line."""
    stack: list[tuple[nodes.Node, int, bool]] = [(tree, 0, False)]
    count = 0
    while stack:
        node, depth, in_concat = stack.pop()
        count += 1
        if count > MAX_TEMPLATE_NODES:
            raise TemplateError(f"more than {MAX_TEMPLATE_NODES} Jinja expressions")
        if depth > MAX_TEMPLATE_DEPTH:
            raise TemplateError(f"line {node.lineno}: expression nested too deeply")
        problem = _construct_problem(node, in_concat)
        if problem:
            raise TemplateError(
                f"line {node.lineno}: {problem} is not allowed in a launch template "
                "(only {{ expressions }} with the sh/shjoin filters, and if/else)"
            )
        inner = in_concat or isinstance(node, nodes.Concat)
        children = [(child, depth + 1, inner) for child in node.iter_child_nodes()]
        stack.extend(reversed(children))  # the first offence in reading order is named


def _construct_problem(node: nodes.Node, in_concat: bool) -> str:
    """What is wrong with one node, in words; empty when it is allowed."""
    kind = type(node).__name__
    if not isinstance(node, _ALLOWED_NODES):
        return _CONSTRUCTS.get(kind, f"`{kind}`")
    if isinstance(node, nodes.Filter | nodes.Test):
        extra = node.args or node.kwargs or node.dyn_args or node.dyn_kwargs
        allowed = _FILTERS if isinstance(node, nodes.Filter) else _TESTS
        if node.name not in allowed:
            return f"the {kind.lower()} `{node.name}`"
        if extra:
            return f"arguments to `{node.name}`"
    if isinstance(node, nodes.Name) and node.ctx != "load":
        return f"assigning to `{node.name}`"
    if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
        return f"the attribute `{node.attr}`"
    if isinstance(node, nodes.Concat) and (in_concat or len(node.nodes) > MAX_CONCAT_OPERANDS):
        return f"`~` with more than {MAX_CONCAT_OPERANDS} operands (or nested)"
    return ""


VarValue = str | tuple[str, ...]


@dataclass(frozen=True)
class LaunchTemplate:
    """A loaded template: its dialect, its current knobs and everything rendering needs.

    `imported` is None for a Jinja template (every knob managed); for an imported script it
    holds the script and which knobs are managed. A knob that is not managed keeps a
    placeholder in `knobs` (the code that walks every knob needs a full mapping) that is never
    rendered, shown as a value, or changed.
    """

    name: str
    dialect: Dialect
    script_source: str
    knobs: Mapping[str, KnobValue]
    sbatch: tuple[tuple[str, str], ...] = ()
    variables: tuple[tuple[str, VarValue], ...] = ()
    config_base: Mapping[str, object] = field(default_factory=dict)
    checkpoint: CheckpointSpec | None = None
    directory: Path | None = None
    imported: ImportedScript | None = None

    @property
    def not_managed(self) -> Mapping[str, str]:
        """Knob -> why it is not managed; empty when every knob is."""
        return _EVERY_KNOB_MANAGED if self.imported is None else self.imported.not_managed


def validate_knobs(
    dialect: Dialect, raw: Mapping[str, object], *, invariant: bool = True
) -> dict[str, KnobValue]:
    """Type- and range-check every knob, fill none in silently, and check the invariant
    (unless `invariant` is False: some of its terms are not known)."""
    unknown = sorted(set(raw) - {spec.name for spec in dialect.knobs})
    if unknown:
        raise KnobError(f"dialect {dialect.name} has no knob(s) {', '.join(unknown)}")
    missing = [spec.name for spec in dialect.knobs if spec.name not in raw]
    if missing:
        raise KnobError(f"missing knob(s) {', '.join(missing)} for dialect {dialect.name}")
    knobs = {spec.name: spec.validate(raw[spec.name]) for spec in dialect.knobs}
    if invariant:
        dialect.geometry(knobs)
    return knobs


def invariant_known(dialect: Dialect, not_managed: Mapping[str, str]) -> bool:
    """Whether every term of the batch invariant is managed, so that it can be checked."""
    return not any(term in not_managed for term in invariant_terms(dialect))


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


# What Python or Jinja can raise while a user's template renders; all become TemplateError.
_RENDER_FAILURES = (
    JinjaTemplateError,  # SecurityError, UndefinedError, TemplateSyntaxError
    KnobError,
    ArithmeticError,  # OverflowError, ZeroDivisionError
    LookupError,
    TypeError,
    ValueError,  # UnicodeError
    AttributeError,
    RecursionError,
    MemoryError,
)


def render(template: LaunchTemplate, knobs: Knobs | None = None) -> str:
    """The sbatch script for these knobs (the template's own when None)."""
    values = template.knobs if knobs is None else knobs
    dialect = template.dialect
    if template.imported is not None:
        try:
            return splice(dialect, template.imported, values)
        except SpliceError as error:
            raise TemplateError(f"template {template.name}: {error}") from error
    try:
        context = {
            "sbatch_header": _sbatch_header(template, values),
            "env_exports": _env_exports(dialect, values),
            "train_args": _args_block(dialect.render_args(values)),
            "config_json": ShellSafe(dialect.render_config(values, template.config_base) or ""),
            "knobs": dict(values),
            "vars": dict(template.variables),
            "name": template.name,
        }
        return _bounded_render(_compiled(template.script_source), context)
    except TemplateError as error:
        raise TemplateError(f"template {template.name}: {error}") from error
    except _RENDER_FAILURES as error:
        raise TemplateError(f"template {template.name}: {type(error).__name__}: {error}") from error


def _bounded_render(compiled: Template, context: Mapping[str, object]) -> str:
    """Render chunk by chunk, stopping at the output cap or the deadline."""
    deadline = time.monotonic() + RENDER_DEADLINE_S
    chunks: list[str] = []
    size = 0
    for chunk in compiled.generate(context):
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise TemplateError(f"the rendered script is over {MAX_RENDERED_CHARS} characters")
        if time.monotonic() > deadline:
            raise TemplateError(f"rendering took over {RENDER_DEADLINE_S:g}s")
        chunks.append(chunk)
    return "".join(chunks)


def _sbatch_header(template: LaunchTemplate, knobs: Knobs) -> ShellSafe:
    nodes, gpus, exclude = knobs["nodes"], knobs["gpus_per_node"], knobs["exclude"]
    lines = [f"#SBATCH --nodes={nodes}", f"#SBATCH --gres=gpu:{gpus}"]
    if isinstance(exclude, tuple) and exclude:
        lines.append(f"#SBATCH --exclude={','.join(str(node) for node in exclude)}")
    lines += [
        f"#SBATCH --{key}={value}" if value else f"#SBATCH --{key}"
        for key, value in template.sbatch
    ]
    return ShellSafe("\n".join(lines))


def _args_block(args: Sequence[str]) -> ShellSafe:
    """One flag and its values per line, so a revision's diff shows exactly the knob that moved."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([])
        groups[-1].append(arg)
    return ShellSafe(" \\\n    ".join(shell_join(group) for group in groups))


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

    def apply(
        self, dialect: Dialect, knobs: Knobs, not_managed: Mapping[str, str] = _EVERY_KNOB_MANAGED
    ) -> dict[str, KnobValue]:
        """The knobs after this patch, validated, invariant checked where its terms are
        managed; refuses a no-op and any change of a knob that is not managed."""
        result = dict(knobs)
        for change in self.changes:
            if change.knob not in result:
                raise TemplateError(f"patch names unknown knob {change.knob!r}")
            if change.knob in not_managed:
                raise TemplateError(
                    f"{change.knob} is not managed in this template: {not_managed[change.knob]}"
                )
            if result[change.knob] != change.before:
                raise TemplateError(
                    f"patch expects {change.knob}={change.before!r} but the revision has "
                    f"{result[change.knob]!r}"
                )
            result[change.knob] = change.after
        if result == dict(knobs):
            raise TemplateError("patch changes nothing: refusing to relaunch the same config")
        try:
            return validate_knobs(dialect, result, invariant=invariant_known(dialect, not_managed))
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
    knobs = patch.apply(template.dialect, parent.knobs, template.not_managed)
    script = render(template, knobs)
    if script == parent.script:
        raise TemplateError(
            f"patch ({patch.describe()}) does not change the rendered script: "
            "the lever would never reach the job"
        )
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


def resume_patch(template: LaunchTemplate, knobs: Knobs, checkpoint: Checkpoint) -> Patch:
    """The patch that makes a revision resume from `checkpoint`, written the dialect's way."""
    dialect = template.dialect
    resume_knob = dialect.roles[Role.RESUME]
    if resume_knob in template.not_managed:
        raise TemplateError(
            f"cannot resume from {checkpoint.path}: {resume_knob} is not managed in this "
            f"template: {template.not_managed[resume_knob]}"
        )
    changes = [KnobChange(resume_knob, knobs[resume_knob], checkpoint.resume_path)]
    tag_knob = dialect.knob_for(Role.RESUME_TAG)
    if tag_knob is not None:
        changes.append(KnobChange(tag_knob, knobs[tag_knob], checkpoint.tag or ""))
    return Patch(
        tuple(change for change in changes if change.before != change.after),
        f"resume from {checkpoint.path} (step {checkpoint.step})",
    )


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
    """Stored knobs read back: types and ranges checked again. The invariant was checked
    where it could be when the revision was made (an imported template may not know all its
    terms, whose placeholders need not satisfy it)."""
    return validate_knobs(dialect, data, invariant=False)


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


# ---------------------------------------------------------------- knob values typed by people


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
