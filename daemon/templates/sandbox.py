"""The Jinja sandbox a launch template renders under.

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
time out; the output cap and the deadline stay as a second line.
"""

from __future__ import annotations

import functools
import re
import shlex
import time
from collections.abc import Callable, Iterable, Mapping

from jinja2 import StrictUndefined, Template, Undefined, nodes
from jinja2 import TemplateError as JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.owner_serve import MAX_TEMPLATE_FILE_BYTES
from daemon.templates.model import TemplateError

_MAX_SCRIPT_BYTES = MAX_TEMPLATE_FILE_BYTES
MAX_RENDERED_CHARS = 2_000_000  # a real script is a few KB
RENDER_DEADLINE_S = 10.0  # a second line: without loops a render takes milliseconds
MAX_JINJA_TAGS = 2_000  # `{{` and `{%` in the source, counted before parsing
MAX_TEMPLATE_NODES = 10_000  # the shipped templates have under 100
MAX_TEMPLATE_DEPTH = 50
MAX_CONCAT_OPERANDS = 4  # `a ~ b` repeats values: keep the product small

# Used with `.match` and ended by \Z: `$` would let a trailing newline into the script.
_SAFE_WORD = re.compile(r"[A-Za-z0-9_./:=@%+,-]*\Z")


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
def compiled(source: str) -> Template:
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


def bounded_render(compiled: Template, context: Mapping[str, object]) -> str:
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
