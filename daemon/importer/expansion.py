"""A shell's variables and how a word expands in them, keeping where each piece was written.

Variables hold `Text`s, so a value keeps the place it was written however many assignments,
`${X:-default}`s and strings it goes through; what cannot be known before the job runs (`$1`,
the environment, `$(cmd)`) stays opaque, as written, with why. The walk (`evaluate`) decides
which commands run; this says what their words are.

A reference copies its variable's value (each character keeps the `$X` it came through), so
`X="$X a"` a few thousand times, or `$Y` of a long value on every line, copies far more than
the script holds: what references copy in one analysis is counted (`Work`), and past
`MAX_COPIED_SEGMENTS` or `MAX_COPIED_CHARS` a reference stays opaque. A real script copies a
few thousand segments.
"""

from __future__ import annotations

import re
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from daemon.importer.lexer import Heredoc, Part, PartKind, Word
from daemon.importer.records import Form
from daemon.importer.shell import Function
from daemon.importer.values import Text, concat, join, whole_number

WORKDIR = "the working directory"
# What references may copy in one analysis: a realistic script of 1 MB (20,000 commands) copies
# 10,000 segments and 320,000 characters; the limits cost a few tenths of a second.
MAX_COPIED_SEGMENTS = 50_000
MAX_COPIED_CHARS = 8_000_000
TOO_MUCH = "not followed: the script's references copy more text than the analysis reads"
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\[(?P<index>[^\]]*)\])?(?P<op>\+?=)")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Var:
    value: Text
    items: tuple[Text, ...] | None = None  # an array's elements
    exported: bool = False


class Env:
    """Variables that remember which names were assigned since this copy was made, so merging
    branches costs what the branches changed, not the number of variables.

    A copy is an overlay on the variables it was made from: it reads through to them and
    writes only its own, so a branch, a pipeline's command or a child process costs nothing
    until it assigns (copying every variable for each `if` was quadratic in a script of many
    exports and tests). The walk is sequential, so the variables under a copy do not change
    while it is in use. `exported_only`: only exported variables show through (a new process).
    """

    __slots__ = ("_exported_only", "_own", "_parent", "changed")

    def __init__(
        self,
        items: Mapping[str, Var] | None = None,
        *,
        parent: Env | None = None,
        exported_only: bool = False,
    ) -> None:
        self._own: dict[str, Var | None] = dict(items or {})  # None: unset in this copy
        self._parent = parent
        self._exported_only = exported_only
        self.changed: set[str] = set()

    def overlay(self, *, exported_only: bool = False) -> Env:
        return Env(parent=self, exported_only=exported_only)

    def get(self, name: str) -> Var | None:
        env: Env | None = self
        exported_only = False
        while env is not None:
            if name in env._own:
                var = env._own[name]
                if var is None or (exported_only and not var.exported):
                    return None
                return var
            exported_only = exported_only or env._exported_only
            env = env._parent
        return None

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str) -> Var:
        var = self.get(name)
        if var is None:
            raise KeyError(name)
        return var

    def __setitem__(self, name: str, var: Var) -> None:
        self._own[name] = var
        self.changed.add(name)

    def forget(self, name: str) -> None:
        self._own[name] = None
        self.changed.add(name)


@dataclass
class Work:
    """What references have copied so far in one analysis, shared by all its shells."""

    segments: int = 0
    chars: int = 0

    def spend(self, segments: int, chars: int = 0) -> bool:
        """Count a copy; False once the analysis has copied past the limits."""
        self.segments += segments
        self.chars += chars
        return not self.exhausted

    @property
    def exhausted(self) -> bool:
        return self.segments > MAX_COPIED_SEGMENTS or self.chars > MAX_COPIED_CHARS


@dataclass
class Shell:
    """One shell process's state: what `$X` gives, `$1`..., functions, working directory."""

    env: Env
    positional: tuple[Text, ...] | None  # None: the arguments are only known at run time
    functions: Functions = field(default_factory=ChainMap)
    cwd: Text | None = field(default_factory=Text)  # relative to the submit directory
    wrappers: tuple[Text, ...] = ()  # what runs this shell: srun and its options, `bash -c`...
    work: Work = field(default_factory=Work)  # shared by every copy and child

    def copy(self) -> Shell:
        """A subshell or a branch: an overlay of the variables and functions (see `Env`)."""
        return Shell(
            self.env.overlay(),
            self.positional,
            self.functions.new_child(),
            self.cwd,
            self.wrappers,
            self.work,
        )

    def child(self, positional: tuple[Text, ...] | None, wrappers: tuple[Text, ...]) -> Shell:
        """A new bash process started by `wrappers`: it sees exported variables only."""
        env = self.env.overlay(exported_only=True)
        return Shell(env, positional, ChainMap(), self.cwd, self.wrappers + wrappers, self.work)


@dataclass(frozen=True)
class Source:
    """Shell text being walked: a file, or an expanded string whose characters are `mapped`."""

    file: str  # the file its characters were read from (for a string: the enclosing file)
    text: str
    mapped: Text | None = None  # None: `text` is the file itself

    def chars(self, start: int, end: int, form: Form) -> Text:
        if self.mapped is None:
            return Text.written(self.file, start, self.text[start:end], form)
        return self.mapped.slice(start, end)

    def place(self, start: int, form: Form) -> tuple[str, int, Form | None] | None:
        if self.mapped is None:
            return self.file, start, form
        return self.mapped.origin_at(start)


Functions = ChainMap[str, tuple[Function, Source]]  # a copy's own definitions over its parent's


def expand_heredoc(heredoc: Heredoc, source: Source, shell: Shell) -> Text:
    """A here-document's body as the command reads it (expanded unless its delimiter is quoted)."""
    if heredoc.quoted:
        return source.chars(heredoc.start, heredoc.body_end, Form.HEREDOC_LITERAL)
    pieces = _parts(heredoc.parts, source, shell, context=Form.HEREDOC)
    return join((piece.text for piece in pieces), "")


def read_assignment(word: Word, source: Source, shell: Shell) -> tuple[str, Var, bool] | None:
    """`NAME=value`, `NAME+=value`, `NAME=(a b c)`: no field splitting for scalars; None
    for a word that only looks like one (`X[$i]=v`)."""
    first = word.parts[0]
    if first.kind is PartKind.ARRAY:
        match = _ASSIGNMENT.match(first.name)
        if match is None:
            return None
        items: list[Text] = []
        for element in first.elements:
            items.extend(expand_word(element, source, shell))
        value = items[0] if items else Text()
        return match.group("name"), Var(value, tuple(items)), match.group("op") == "+="
    raw = source.text[first.start : first.end]
    match = _ASSIGNMENT.match(raw) if first.kind is PartKind.LITERAL else None
    if match is None:
        return None
    rest_start = first.start + match.end()
    parts = (Part(PartKind.LITERAL, rest_start, first.end), *word.parts[1:])
    pieces = _parts(parts, source, shell, context=Form.SHELL_WORD)
    value = join((piece.text for piece in pieces), "")
    if match.group("index") is not None:
        name = match.group("name")
        previous = shell.env.get(name)
        items = list(previous.items) if previous and previous.items else []
        if not shell.work.spend(len(items)):
            return name, Var(Text.unknown(f"${name}", TOO_MUCH)), False
        return name, Var(previous.value if previous else value, tuple(items)), False
    return match.group("name"), Var(value), match.group("op") == "+="


def expand_words(words: tuple[Word, ...], source: Source, shell: Shell) -> list[Text]:
    """The fields of a command's words, in order."""
    fields: list[Text] = []
    for word in words:
        fields.extend(expand_word(word, source, shell))
    return fields


def expand_single(word: Word, source: Source, shell: Shell) -> Text:
    """A word as one text, never split (an assignment's value, a redirection's target)."""
    pieces = _parts(word.parts, source, shell, context=Form.SHELL_WORD)
    return join((piece.text for piece in pieces), "")


def expand_word(word: Word, source: Source, shell: Shell) -> list[Text]:
    """A word's fields: unquoted expansions split at blanks, "$@"-like ones into many. Each
    field's pieces are joined once (`concat`), not added one by one."""
    fields: list[Text] = []
    current: list[Text] = []
    started = False
    for piece in _parts(word.parts, source, shell, context=Form.SHELL_WORD):
        if piece.brk:
            if started:
                fields.append(concat(current))
            current, started = [], False
            continue
        if not piece.split:
            current.append(piece.text)
            started = started or piece.quoted or bool(piece.text)
            continue
        parts, leading, trailing = piece.text.split_blanks()
        if leading and started:
            fields.append(concat(current))
            current, started = [], False
        for index, part in enumerate(parts):
            if index:
                fields.append(concat(current))
                current = []
            current.append(part)
            started = True
        if trailing and parts:
            fields.append(concat(current))
            current, started = [], False
    if started:
        fields.append(concat(current))
    return fields


_TEXT_KINDS = frozenset({PartKind.LITERAL, PartKind.QUOTED_TEXT})
_ESCAPE_KINDS = frozenset({PartKind.ESCAPE, PartKind.QUOTED_ESCAPE})


def _parts(parts: tuple[Part, ...], source: Source, shell: Shell, context: Form) -> list[_Piece]:
    """Expand parts into pieces; `context` is the quoting they sit in."""
    pieces: list[_Piece] = []
    quoted = context is not Form.SHELL_WORD
    text_form = context if quoted else Form.SHELL_WORD
    for part in parts:
        kind = part.kind
        if kind in _TEXT_KINDS:
            pieces.append(_Piece(source.chars(part.start, part.end, text_form), quoted=quoted))
        elif kind in _ESCAPE_KINDS:
            pieces.append(_Piece(source.chars(part.start + 1, part.end, text_form), True))
        elif kind is PartKind.CONTINUATION:
            continue
        elif kind is PartKind.SINGLE_QUOTED:
            inner = source.chars(
                part.start + 1, max(part.end - 1, part.start + 1), Form.SINGLE_QUOTED
            )
            pieces.append(_Piece(inner, quoted=True))
        elif kind is PartKind.ANSI_C:
            raw = source.text[part.start + 2 : max(part.end - 1, part.start + 2)]
            if "\\" in raw:
                pieces.append(_Piece(Text.derived(_ansi_c(raw)), quoted=True))
            else:
                pieces.append(
                    _Piece(
                        source.chars(part.start + 2, part.start + 2 + len(raw), Form.ANSI_C),
                        quoted=True,
                    )
                )
        elif kind is PartKind.DOUBLE_QUOTED:
            children = _parts(part.children, source, shell, context=Form.DOUBLE_QUOTED)
            if not children:
                pieces.append(_Piece(Text(), quoted=True))
            pieces.extend(children)
        elif kind is PartKind.PARAM:
            pieces.extend(_param(part, source, shell, context))
        else:
            expression = source.text[part.start : part.end]
            why = _OPAQUE_WHY.get(kind, "computed at run time")
            if expression in {"$(pwd)", "`pwd`"}:
                why = WORKDIR
            place = source.place(part.start, text_form)
            pieces.append(
                _Piece(Text.unknown(expression, why, place), split=not quoted, quoted=quoted)
            )
    return pieces


def _param(part: Part, source: Source, shell: Shell, context: Form) -> list[_Piece]:
    quoted = context is not Form.SHELL_WORD
    form = context if quoted else Form.SHELL_WORD
    expression = source.text[part.start : part.end]
    place = source.place(part.start, form)

    def unknown(why: str) -> Text:
        return Text.unknown(expression, why, place)

    def through(value: Text) -> Text:
        if place is None or not value:
            return value
        if not shell.work.spend(len(value.segs), len(value.plain)):
            return unknown(TOO_MUCH)
        file, start, where = place
        return value.through(file, start, start + len(expression), where or form)

    name, op = part.name, part.op
    if name in {"@", "*"}:
        if shell.positional is None:
            return [_Piece(unknown("the script's arguments"), split=not quoted, quoted=quoted)]
        return _many(list(shell.positional), name == "@" and quoted, quoted, through, shell)
    if part.index in {"@", "*"} and op == "":
        var = shell.env.get(name)
        if var is None:
            return [_Piece(unknown("not set in the script"), split=not quoted, quoted=quoted)]
        items = list(var.items) if var.items is not None else [var.value]
        return _many(items, part.index == "@" and quoted, quoted, through, shell)
    if op in {"len", "other"}:
        return [_Piece(unknown("computed at run time"), split=not quoted, quoted=quoted)]
    value = _lookup(name, part.index, shell)
    if value is None and op and name in SLURM_JOB_VARIABLES:
        value = unknown(_unset_why(name))  # `${SLURM_NNODES:-1}`: the default is never used
    is_set = value is not None and (not op.startswith(":") or value.opaque or bool(value))
    if op == "":
        result = through(value) if value is not None else unknown(_unset_why(name))
    elif op in {"-", ":-", "=", ":="}:
        if is_set and value is not None:
            result = through(value)
        else:
            default = _operand(part, source, shell, context)
            if op in {"=", ":="} and NAME.match(name):
                assign(shell, name, Var(default), append=False)
            result = default
    elif op in {"?", ":?"}:
        result = (
            through(value)
            if is_set and value is not None
            else unknown(f"required at run time ({name})")
        )
    elif value is not None and value.opaque:  # + and :+ on a value known at run time only
        result = unknown("depends on whether it is set at run time")
    else:
        result = _operand(part, source, shell, context) if is_set else Text()
    return [_Piece(result, split=not quoted, quoted=quoted)]


def _many(
    items: list[Text],
    separate: bool,
    quoted: bool,
    through: Callable[[Text], Text],
    shell: Shell,
) -> list[_Piece]:
    """ "$@", ${A[@]}: each item its own field when quoted, else all joined by blanks."""
    if not separate:
        return [_Piece(through(join(items)), split=not quoted, quoted=quoted)]
    if not shell.work.spend(len(items)):  # past the limits `through` gives one opaque piece
        return [_Piece(through(join(items)), split=not quoted, quoted=quoted)]
    pieces: list[_Piece] = []
    for index, item in enumerate(items):
        if index:
            pieces.append(_Piece(Text(), brk=True))
        pieces.append(_Piece(through(item), quoted=True))
    return pieces


def _operand(part: Part, source: Source, shell: Shell, context: Form) -> Text:
    pieces = _parts(part.children, source, shell, context)
    return join((piece.text for piece in pieces), "")


def _lookup(name: str, index: str, shell: Shell) -> Text | None:
    if name.isdigit():
        if shell.positional is None:
            return None if name != "0" else Text.unknown("$0", "the script's path")
        position = int(name) - 1
        if name == "0" or position >= len(shell.positional):
            return None if name != "0" else Text.unknown("$0", "the script's path")
        return shell.positional[position]
    if name in {"#", "?", "$", "!", "-"}:
        return Text.unknown(f"${name}", "computed at run time")
    var = shell.env.get(name)
    if var is None:
        if name in {"PWD"}:
            return Text.unknown("$PWD", WORKDIR)
        return None
    if index and var.items is not None:
        item = whole_number(index) if index.isdigit() else None
        if item is not None and item < len(var.items):
            return var.items[item]
        return Text.unknown(f"${{{name}[{index}]}}", "an array element chosen at run time")
    return var.value


# Set by sbatch in every batch job (sbatch(1), OUTPUT ENVIRONMENT VARIABLES), whatever the
# directives say: a default written for one of them is never what the job reads.
SLURM_JOB_VARIABLES = frozenset(
    {
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_JOBNAME",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_SUBMIT_DIR",
        "SLURM_SUBMIT_HOST",
        "SLURM_CLUSTERNAME",
        "SLURM_JOB_PARTITION",
        "SLURM_JOB_CPUS_PER_NODE",
        "SLURM_NODEID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    }
)


@dataclass(frozen=True, slots=True)
class _Piece:
    text: Text
    quoted: bool = False
    split: bool = False  # an unquoted expansion: split at blanks
    brk: bool = False  # a boundary between fields ("$@")


_OPAQUE_WHY = {
    PartKind.COMMAND_SUB: "a command's output at run time",
    PartKind.ARITH: "arithmetic at run time",
    PartKind.PROCESS_SUB: "a process substitution",
}


def _unset_why(name: str) -> str:
    if name.isdigit():
        return f"the script's argument ${name}, given at submission"
    if name.startswith("SLURM"):
        return "set by Slurm in the job"
    return "not set in the script: from the environment"


def assign(shell: Shell, name: str, var: Var, append: bool) -> None:
    """`NAME=value` or `NAME+=value` in `shell`; a variable once exported stays exported."""
    previous = shell.env.get(name)
    if append and previous is not None:
        # `X+=...` copies X: counted like a reference, or `X+=a` repeated would be quadratic.
        copied = len(previous.items or ()) + len(previous.value.segs)
        if not shell.work.spend(copied, len(previous.value.plain)):
            var = Var(Text.unknown(f"${name}", TOO_MUCH), None, previous.exported or var.exported)
        elif var.items is not None:
            items = (previous.items or (previous.value,)) + var.items
            var = Var(items[0], items, previous.exported or var.exported)
        else:
            var = Var(previous.value + var.value, None, previous.exported or var.exported)
    elif previous is not None and previous.exported:
        var = replace(var, exported=True)
    shell.env[name] = var


def _ansi_c(raw: str) -> str:
    escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "a": "\a", "r": "\r"}
    return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), "\\" + m.group(1)), raw)
