"""Launch templates: typed knobs, sandboxed rendering, and revisions made by typed patches.

A template is a directory holding `template.toml` (name, dialect, knobs, env, sbatch options,
free variables, checkpoint layout) and a Jinja2 sbatch script. The directory is the user's: the
daemon reads it as its owner through `daemon.owner_files` (regular files inside the directory,
1 MB each at most), the CLI as the caller, through the same walk.

Rendering runs in a sandbox with undefined names as errors, and a finalizer that refuses any
string not proven shell-safe: a job name or a path reaches the script only through the `sh`
filter or pre-quoted fragments. The script is the user's text run by root, so its Jinja is held
to a whitelist of constructs, checked on the parsed tree before anything runs: output
(`{{ expr }}`), names, attributes and items, constants, the `sh`/`shjoin` filters, the
`defined`/`none` tests, `if`/`elif`/`else`, comparisons, `and`/`or`/`not` and a short `~`.
Loops, macros, call blocks, include/import/extends, `set`, arithmetic and function calls are
refused with the line that holds them. A whitelist rather than budgets: the shipped templates
(and imported ones) use nothing else, and without loops, calls or arithmetic the work and the
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

from jinja2 import StrictUndefined, Template, Undefined, nodes
from jinja2 import TemplateError as JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.checkpoints import Checkpoint, CheckpointLayout, CheckpointSpec
from daemon.dialects import get_dialect
from daemon.dialects.base import Dialect, KnobError, KnobKind, Knobs, KnobValue, Role
from daemon.owner_files import (
    MAX_TEMPLATE_FILE_BYTES,
    TEMPLATE_FILE,
    OwnerFiles,
    OwnerReadRefused,
    TemplateTexts,
)
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist

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
    if len(name) > MAX_NAME_CHARS:
        raise TemplateError(f"template name longer than {MAX_NAME_CHARS} characters")
    dialect = get_dialect(_required_str(document, "dialect"))
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
    return parse_template(document, texts.script_text, directory)


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
    if isinstance(value, int | float):
        return repr(value)
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
    lines += ["", "[sbatch]"]
    lines += [f"{key} = {toml_value(value or True)}" for key, value in sbatch]
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


# ---------------------------------------------------------------- importing a script

_SHORT_OPTIONS = {
    "-N": "nodes",
    "-J": "job-name",
    "-t": "time",
    "-p": "partition",
    "-o": "output",
    "-e": "error",
    "-x": "exclude",
    "-A": "account",
    "-n": "ntasks",
    "-c": "cpus-per-task",
    "-G": "gpus",
    "-q": "qos",
}
_GPU_COUNT = re.compile(r"^(?:gpu:)?(?:[A-Za-z0-9_.-]+:)?(\d+)$")
_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config")
_CHECKPOINT_FLAGS = {
    "hf": ("--output_dir",),
    "megatron": ("--save",),
    "deepspeed": ("--save_dir", "--output_dir"),
    "torchrun": (),
}
_CHECKPOINT_ENV = {"torchrun": ("CKPT_DIR", "CHECKPOINT_DIR")}
_CHECKPOINT_LAYOUTS = {
    "hf": CheckpointLayout.HF,
    "megatron": CheckpointLayout.MEGATRON,
    "deepspeed": CheckpointLayout.DEEPSPEED,
    "torchrun": CheckpointLayout.DCP,
}
_LAUNCHERS = frozenset({"srun", "torchrun", "deepspeed", "python", "python3", "accelerate"})
SCRIPT_FILE = "job.sbatch.j2"


@dataclass(frozen=True)
class Recognised:
    """A knob read from the script, and the line it came from."""

    knob: str
    value: KnobValue
    source: str


@dataclass(frozen=True)
class ImportResult:
    """An imported template and the account of what was recognised, defaulted and kept as is."""

    template: LaunchTemplate
    toml_text: str
    script_source: str
    recognised: tuple[Recognised, ...]
    defaulted: tuple[str, ...]
    kept: tuple[str, ...]
    notes: tuple[str, ...]


@dataclass
class _Importer:
    dialect: Dialect
    read_file: Callable[[str], str] | None
    knobs: dict[str, KnobValue] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    sbatch: list[tuple[str, str]] = field(default_factory=list)
    recognised: list[Recognised] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config_base: dict[str, object] = field(default_factory=dict)
    checkpoint_root: str | None = None

    def take(self, knob: str, value: KnobValue, source: str) -> None:
        self.knobs[knob] = value
        self.recognised.append(Recognised(knob, value, source))

    def take_text(self, knob: str, text: str, source: str) -> bool:
        try:
            self.take(knob, parse_knob_text(self.dialect, knob, text), source)
        except KnobError as error:
            self.notes.append(f"{source}: {error}")
            return False
        return True


def import_script(
    text: str,
    *,
    dialect_name: str,
    name: str,
    read_file: Callable[[str], str] | None = None,
) -> ImportResult:
    """Turn an sbatch script into a template by recognising the dialect's flags and variables.

    Recognised knobs are replaced by their rendered form; everything else is kept verbatim and
    listed, so nothing the script did is silently lost. `read_file` resolves a DeepSpeed config
    path named in the script (relative paths as the caller sees fit).
    """
    if "\0" in text or len(text) > _MAX_SCRIPT_BYTES:
        raise TemplateError("not a script: binary content or over 1 MB")
    dialect = get_dialect(dialect_name)
    importer = _Importer(dialect, read_file)
    lines = _logical_lines(text.replace("\r\n", "\n"))
    header: list[str] = []
    prelude: list[str] = []
    epilogue: list[str] = []
    launch: str | None = None
    for number, line in lines:
        stripped = line.strip()
        where = f"line {number}"
        if number == 1 and stripped.startswith("#!"):
            continue
        if stripped.startswith("#SBATCH"):
            if not _sbatch_line(importer, stripped, where):
                header.append(line)
            continue
        if (
            launch is None
            and stripped.startswith("export ")
            and _export_line(importer, line, where)
        ):
            continue
        if launch is None and _is_launch(importer.dialect, stripped):
            launch = _launch_line(importer, stripped, where)
            continue
        (prelude if launch is None else epilogue).append(line)
    if launch is None:
        raise TemplateError(
            f"no launch line with {dialect.title} flags found; flags kept in a shell variable "
            "(e.g. $OPTIONS) are not followed: write them on the launch line"
        )
    for line in header + prelude + epilogue:
        if line.strip() and not line.strip().startswith("#"):
            importer.kept.append(f"kept verbatim: {line.strip()[:120]}")
    defaulted = _fill_defaults(importer)
    importer.knobs["env"] = dialect.spec("env").validate(importer.env)
    checkpoint = None
    if importer.checkpoint_root:
        checkpoint = CheckpointSpec(_CHECKPOINT_LAYOUTS[dialect.name], importer.checkpoint_root)
    else:
        importer.notes.append("checkpoint location not recognised: add a [checkpoint] table")
    script = _imported_script(dialect, header, prelude, launch, epilogue)
    toml_text = template_toml(
        name=name,
        dialect=dialect.name,
        script=SCRIPT_FILE,
        knobs=importer.knobs,
        sbatch=importer.sbatch,
        variables=(),
        config_base=importer.config_base,
        checkpoint=checkpoint,
    )
    template = parse_template(tomllib.loads(toml_text), script)
    return ImportResult(
        template=template,
        toml_text=toml_text,
        script_source=script,
        recognised=tuple(importer.recognised),
        defaulted=tuple(defaulted),
        kept=tuple(importer.kept),
        notes=tuple(importer.notes),
    )


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, each with its first physical line number."""
    result: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 1
    for number, line in enumerate(text.split("\n"), start=1):
        if not pending:
            start = number
        if line.endswith("\\") and not line.lstrip().startswith("#"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        result.append(
            (start, " ".join(part.strip() if i else part for i, part in enumerate(pending)))
        )
        pending = []
    if pending:
        result.append((start, " ".join(pending)))
    if result and result[-1][1] == "":
        result.pop()
    return result


def _split(text: str) -> list[str] | None:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return None


def _sbatch_line(importer: _Importer, line: str, where: str) -> bool:
    """Take a `#SBATCH` line into knobs/options; False when it must be kept verbatim."""
    tokens = _split(line.removeprefix("#SBATCH"))
    if not tokens or not tokens[0].startswith("-"):
        return False
    option, _, value = tokens[0].partition("=")
    if not value and len(tokens) > 1:
        value = tokens[1]
    key = _SHORT_OPTIONS.get(option, option.removeprefix("--"))
    if len(tokens) == 1 and not value and _SBATCH_KEY.match(key) and key not in _KNOB_OWNED_OPTIONS:
        importer.sbatch.append((key, ""))
        return True
    if key == "nodes":
        if not importer.take_text("nodes", value, f"{where}: #SBATCH {tokens[0]}"):
            raise TemplateError(f"{where}: --nodes {value!r} must be one fixed count to be a knob")
        return True
    if key in {"gres", "gpus-per-node"}:
        match = _GPU_COUNT.match(value)
        if not match:
            raise TemplateError(f"{where}: --{key} {value!r} is not one GPU count per node")
        importer.take("gpus_per_node", int(match.group(1)), f"{where}: #SBATCH --{key}")
        return True
    if key == "exclude":
        _exclude(importer, value, where)
        return True
    if _SBATCH_KEY.match(key) and value and _SBATCH_VALUE.match(value) and len(tokens) <= 2:
        importer.sbatch.append((key, value))
        return True
    importer.kept.append(f"{where}: #SBATCH {key} kept verbatim (value needs quoting)")
    return False


def _exclude(importer: _Importer, value: str, where: str) -> None:
    try:
        nodes = importer.dialect.spec("exclude").validate(list(expand_hostlist(value)))
    except (SlurmParseError, KnobError) as error:
        raise TemplateError(f"{where}: exclude list {value!r} not understood: {error}") from error
    importer.take("exclude", nodes, f"{where}: exclude")


def _export_line(importer: _Importer, line: str, where: str) -> bool:
    tokens = _split(line)
    if not tokens or len(tokens) != 2 or "=" not in tokens[1] or any(c in line for c in "$`"):
        return False
    variable, _, value = tokens[1].partition("=")
    if variable in _CHECKPOINT_ENV.get(importer.dialect.name, ()) and _SAFE_WORD.match(value):
        importer.checkpoint_root = value
    knob = importer.dialect.recognise_env.get(variable)
    if knob is not None:
        return importer.take_text(knob, value, f"{where}: export {variable}")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", variable) or any(ord(c) < 32 for c in value):
        return False
    importer.env[variable] = value
    importer.recognised.append(Recognised("env", ((variable, value),), f"{where}: export"))
    return True


def _is_launch(dialect: Dialect, line: str) -> bool:
    tokens = _split(line)
    if not tokens:
        return False
    flags = {token.partition("=")[0] for token in tokens}
    if flags & set(dialect.recognise_flags) or flags & set(_CONFIG_FLAGS):
        return True
    return dialect.name == "torchrun" and bool({"torchrun", "srun"} & set(tokens))


def _raw_words(line: str) -> list[tuple[str, str]]:
    """Shell words as written and as the shell reads them: (raw text, unquoted value).

    Keeping the raw text lets an unrecognised word go back into the template exactly as the
    user wrote it (its quotes decide whether `$VAR` expands); only the value is interpreted.
    """
    words: list[str] = []
    current: list[str] = []
    quote = ""
    index = 0
    while index < len(line):
        char = line[index]
        if quote:
            current.append(char)
            if char == "\\" and quote == '"' and index + 1 < len(line):
                current.append(line[index + 1])
                index += 1
            elif char == quote:
                quote = ""
        elif char == "\\" and index + 1 < len(line):
            current += [char, line[index + 1]]
            index += 1
        elif char in "'\"":
            quote = char
            current.append(char)
        elif char.isspace():
            if current:
                words.append("".join(current))
                current = []
        elif char == "#" and not current:
            break
        else:
            current.append(char)
        index += 1
    if quote:
        raise TemplateError(f"unterminated {quote} quote in the launch line")
    if current:
        words.append("".join(current))
    return [(word, "".join(shlex.split(word))) for word in words]


def _launch_line(importer: _Importer, line: str, where: str) -> str:
    """Recognise the launch command's knob flags; return the line that replaces it, keeping
    every unrecognised word exactly as written."""
    words = _raw_words(line)
    values_only = [value for _, value in words]
    program = next((i for i, value in enumerate(values_only) if value.endswith(".py")), None)
    if program is None:
        first_flag = next(
            (i for i, value in enumerate(values_only) if value.startswith("--")), len(words)
        )
        program = first_flag - 1
    head, rest = words[: program + 1], words[program + 1 :]
    kept = [raw for raw, _ in head]
    index = 0
    while index < len(rest):
        raw, value = rest[index]
        flag, equals, inline = value.partition("=")
        following: list[tuple[str, str]] = []
        index += 1
        if not equals:
            while index < len(rest) and not rest[index][1].startswith("--"):
                following.append(rest[index])
                index += 1
        values = [inline] if equals else [item for _, item in following]
        raw_values = [item for item, _ in following]
        if any("$" in item or "`" in item for item in ([raw] if equals else raw_values)):
            if flag in importer.dialect.recognise_flags:
                importer.notes.append(f"{where}: {flag}: value is a shell expansion, kept verbatim")
            consumed = None
        else:
            consumed = _launch_flag(importer, flag, values, f"{where}: {flag}")
        if consumed is None:
            kept += [raw, *raw_values]
        elif not equals:
            kept += raw_values[consumed:]
    return " ".join(kept)


def _launch_flag(importer: _Importer, flag: str, values: list[str], source: str) -> int | None:
    """How many of `values` the flag consumed when recognised, None to keep it verbatim."""
    dialect = importer.dialect
    if flag in _CHECKPOINT_FLAGS[dialect.name] and values and _SAFE_WORD.match(values[0]):
        importer.checkpoint_root = values[0]
        return None
    if dialect.name == "deepspeed" and flag in _CONFIG_FLAGS and values:
        _deepspeed_config(importer, values[0], source)
        return 1
    knob = dialect.recognise_flags.get(flag)
    if knob is None:
        return None
    spec = dialect.spec(knob)
    if spec.kind is KnobKind.BOOL:
        if values and values[0].lower() in {"true", "false", "1", "0"}:
            return 1 if importer.take_text(knob, values[0], source) else None
        importer.take(knob, True, source)
        return 0
    if spec.kind is KnobKind.NAMES:
        return len(values) if importer.take_text(knob, " ".join(values), source) else None
    if not values:
        importer.notes.append(f"{source}: flag without a value, kept verbatim")
        return None
    return 1 if importer.take_text(knob, values[0], source) else None


def _deepspeed_config(importer: _Importer, path: str, source: str) -> None:
    if importer.read_file is None:
        importer.notes.append(f"{source}: config {path!r} not read (no reader given)")
        return
    try:
        config = json.loads(importer.read_file(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        importer.notes.append(f"{source}: cannot read DeepSpeed config {path!r}: {error}")
        return
    if not isinstance(config, dict):
        importer.notes.append(f"{source}: DeepSpeed config {path!r} is not an object")
        return
    where = f"{source} {path}"
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.pop(key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            importer.take(key, value, f"{where}: {key}")
        elif value is not None:
            importer.notes.append(f"{where}: {key} = {value!r} not a number ('auto'?); defaulted")
    declared = config.pop("train_batch_size", None)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        zero = dict(zero)
        stage = zero.pop("stage", None)
        if isinstance(stage, int):
            importer.take("zero_stage", stage, f"{where}: zero_optimization.stage")
        for key in ("offload_optimizer", "offload_param"):
            offload = zero.pop(key, None)
            if isinstance(offload, dict) and isinstance(offload.get("device"), str):
                importer.take_text(key, offload["device"], f"{where}: {key}.device")
        config["zero_optimization"] = zero
    importer.config_base = config
    if isinstance(declared, int):
        importer.notes.append(
            f"{where}: train_batch_size {declared} is now computed from micro x accum x GPUs"
        )


def _fill_defaults(importer: _Importer) -> list[str]:
    dialect = importer.dialect
    defaulted = []
    for spec in dialect.knobs:
        if spec.name in importer.knobs or spec.name == "env":
            continue
        importer.knobs[spec.name] = dialect.defaults[spec.name]
        defaulted.append(spec.name)
    if dialect.global_batch_fixed:
        global_knob = dialect.roles[Role.GLOBAL_BATCH]
        if global_knob in defaulted:
            micro = importer.knobs[dialect.roles[Role.MICRO_BATCH]]
            nodes, gpus = importer.knobs["nodes"], importer.knobs["gpus_per_node"]
            if isinstance(micro, int) and isinstance(nodes, int) and isinstance(gpus, int):
                importer.knobs[global_knob] = micro * nodes * gpus
                importer.notes.append(f"{global_knob} not found: set to micro x GPUs (accum 1)")
    return defaulted


def _literal(text: str) -> str:
    """Script text carried into a template, protected from Jinja."""
    if not any(marker in text for marker in ("{{", "{%", "{#")):
        return text
    if "endraw" in text:
        raise TemplateError("the script contains Jinja `endraw`: cannot import it safely")
    return "{% raw %}" + text + "{% endraw %}"


def _imported_script(
    dialect: Dialect, header: list[str], prelude: list[str], launch: str, epilogue: list[str]
) -> str:
    """The template script: the user's own lines protected from Jinja, ours around them."""
    parts = ["#!/bin/bash", "{{ sbatch_header }}", *map(_literal, header)]
    parts += ["# Imported by slurm-medic: knobs live in template.toml.", *map(_literal, prelude)]
    parts += ["{{ env_exports }}"]
    if dialect.name == "deepspeed":
        parts += [
            'DS_CONFIG="$PWD/.ds_config.${SLURM_JOB_ID}.json"',
            "cat > \"$DS_CONFIG\" <<'MEDIC_DS_CONFIG'",
            "{{ config_json }}",
            "MEDIC_DS_CONFIG",
            _literal(launch)
            + ' \\\n    --deepspeed_config "$DS_CONFIG"'
            + "{% if train_args %} \\\n    {{ train_args }}{% endif %}",
        ]
    else:
        parts += [_literal(launch) + "{% if train_args %} \\\n    {{ train_args }}{% endif %}"]
    parts += map(_literal, epilogue)
    return "\n".join(parts) + "\n"
