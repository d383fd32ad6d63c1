"""Walks a script the way bash would up to each launch, without running anything.

Variables hold `Text`s, so a value keeps the place it was written however many assignments,
`${X:-default}`s, strings and `bash -c` levels it goes through. What cannot be known before the
job runs (`$1`, the environment, `$(cmd)`) stays opaque, as written. Branches whose condition
can be decided from the script itself (`[ -n "$X" ]` with X assigned above, `case` on a known
word) are taken or skipped like bash would; other branches are each walked on a copy of the
variables and a variable they leave different becomes opaque ("depends on a condition").

Commands that run other shell code are followed: `bash -c STRING`, `bash FILE`, `source FILE`,
`./script.sh`, functions. Commands that start a training program are handed to the caller as
`Call`s; files the script writes with a here-document (`cat <<EOF > ds.json`) are kept as
virtual files. Work is bounded: nesting depth, commands walked and characters re-read.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from daemon.importer.records import Form
from daemon.importer.shell import (
    Case,
    Chain,
    Command,
    Function,
    Group,
    Heredoc,
    If,
    Loop,
    Node,
    Part,
    PartKind,
    Word,
    parse_tokens,
    tokenize,
)
from daemon.importer.values import MAX_FRAMES, Frame, Seg, Text, join, written_length
from daemon.importer.vocabulary import NOT_LAUNCHERS, launcher_kind

MAX_SHELL_DEPTH = 8  # bash -c inside a wrapper inside a function...: real scripts use 3
MAX_COMMANDS = 20_000  # commands walked per analysis (a script has a few hundred)
MAX_REREAD_CHARS = 4_000_000  # characters re-tokenized for nested strings and files, in all
MAX_CALLS = 256  # launch commands read per analysis (a script has one or two)

WORKDIR = "the working directory"
_OPAQUE_MASK = "\x01"  # stands for a run-time value inside a string read again as code
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\[(?P<index>[^\]]*)\])?(?P<op>\+?=)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh"})
_SOURCE = frozenset({"source", "."})
_DECLARE = frozenset({"export", "declare", "typeset", "local", "readonly"})
_NOT_WRAPPERS = ("activate", ".bashrc", ".bash_profile", ".profile", ".env", "/etc/", "env.sh")
_TEST_UNARY: dict[str, Callable[[str], bool]] = {"-n": bool, "-z": lambda s: not s}
_TEST_INT = {
    "-eq": lambda a, b: a == b,
    "-ne": lambda a, b: a != b,
    "-lt": lambda a, b: a < b,
    "-le": lambda a, b: a <= b,
    "-gt": lambda a, b: a > b,
    "-ge": lambda a, b: a >= b,
}


@dataclass(frozen=True)
class Var:
    value: Text
    items: tuple[Text, ...] | None = None  # an array's elements
    exported: bool = False


class Env(dict[str, Var]):
    """Variables that remember which names were assigned since this copy was made, so merging
    branches costs what the branches changed, not the number of variables."""

    __slots__ = ("changed",)

    def __init__(self, items: Mapping[str, Var] | None = None) -> None:
        super().__init__(items or {})
        self.changed: set[str] = set()

    def __setitem__(self, name: str, var: Var) -> None:
        super().__setitem__(name, var)
        self.changed.add(name)

    def forget(self, name: str) -> None:
        self.pop(name, None)
        self.changed.add(name)


@dataclass
class Shell:
    """One shell process's state: what `$X` gives, `$1`..., functions, working directory."""

    env: Env
    positional: tuple[Text, ...] | None  # None: the arguments are only known at run time
    functions: dict[str, tuple[Function, Source]] = field(default_factory=dict)
    cwd: Text | None = field(default_factory=Text)  # relative to the submit directory
    wrappers: tuple[Text, ...] = ()  # what runs this shell: srun and its options, `bash -c`...

    def copy(self) -> Shell:
        return Shell(Env(self.env), self.positional, dict(self.functions), self.cwd, self.wrappers)

    def child(self, positional: tuple[Text, ...] | None, wrappers: tuple[Text, ...]) -> Shell:
        """A new bash process started by `wrappers`: it sees exported variables only."""
        env = Env({name: var for name, var in self.env.items() if var.exported})
        return Shell(env, positional, {}, self.cwd, self.wrappers + wrappers)


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


@dataclass(frozen=True)
class Anchor:
    """The command a launch was found in, for the report and for appending arguments."""

    file: str
    offset: int  # where the command starts in that file's text


@dataclass(frozen=True)
class ArgsEnd:
    """Where the last argument of a command ends: in a file, or inside an expanded string."""

    source: Source  # a string read as code when `source.mapped` is set
    offset: int  # in source.text: the end of the command's last word


@dataclass(frozen=True)
class Call:
    """A command that may start training: its fields from the launcher word on."""

    fields: tuple[Text, ...]
    before: tuple[Text, ...]  # wrapper fields before it (srun and its options...)
    env: Mapping[str, Var]  # the variables the launched process sees (exported ones)
    unexported: frozenset[str]  # assigned but not exported at this point
    anchor: Anchor
    args_end: ArgsEnd
    cwd: Text | None
    virtual: Mapping[str, Text]


@dataclass(frozen=True)
class Missing:
    """A script the job runs or sources that was not given: its knobs are not in view."""

    path: Text
    resolved: str | None  # as the job would open it; None when only known at run time
    arguments: tuple[Text, ...]
    anchor: Anchor
    sourced: bool
    args_end: ArgsEnd


class Evaluator:
    """Walks scripts; reports launches through `on_call`, unreadable scripts through
    `on_missing`."""

    def __init__(
        self,
        files: Mapping[str, str],
        on_call: Callable[[Call], None],
        on_missing: Callable[[Missing], None],
    ) -> None:
        self.files = {posixpath.normpath(path): text for path, text in files.items()}
        self.on_call = on_call
        self.on_missing = on_missing
        self.virtual: dict[str, Text] = {}
        self.notes: list[str] = []
        self.files_read: list[str] = []
        self.commands = 0
        self.calls = 0
        self.outer: Anchor | None = None  # the top command running the string being walked
        self.reread = 0
        self.depth = 0

    # ------------------------------------------------------------ entry points

    def run_file(self, file: str, text: str, shell: Shell) -> None:
        if not self._enter(len(text), f"{file}: not followed (nesting or size limit)"):
            return
        outer, self.outer = self.outer, None  # a file's commands are anchored in the file
        try:
            source = Source(file, text)
            self._walk(parse_tokens(text, tokenize(text)), source, shell)
        finally:
            self.depth -= 1
            self.outer = outer

    def run_string(self, text: Text, shell: Shell, anchor: Anchor) -> None:
        """Run a string as shell code (`bash -c`, `eval`) started by the command at `anchor`.
        What the outer shell only knows at run time is masked as one opaque word, so it is not
        read again as code."""
        if not self._enter(len(text), "a nested command string is not followed (limit)"):
            return
        outer, self.outer = self.outer, self.outer or anchor
        try:
            masked = "".join(
                _OPAQUE_MASK * len(seg.text) if seg.opaque else seg.text for seg in text.segs
            )
            source = Source(anchor.file, masked, text)
            self._walk(parse_tokens(masked, tokenize(masked)), source, shell)
        finally:
            self.depth -= 1
            self.outer = outer

    def _enter(self, size: int, refusal: str) -> bool:
        if self.depth >= MAX_SHELL_DEPTH or self.reread + size > MAX_REREAD_CHARS:
            self.notes.append(refusal)
            return False
        self.depth += 1
        self.reread += size
        return True

    # ------------------------------------------------------------ walking

    def _walk(self, nodes: tuple[Node, ...], source: Source, shell: Shell) -> None:
        for node in nodes:
            self._node(node, source, shell)

    def _node(self, node: Node, source: Source, shell: Shell) -> bool | None:
        """Walk one node; its exit status: a test the script decides, True for any other
        command (a chain is read on its success path), None when only known at run time."""
        self.commands += 1
        if self.commands > MAX_COMMANDS:
            if self.commands == MAX_COMMANDS + 1:
                self.notes.append(f"stopped after {MAX_COMMANDS} commands")
            return None
        if isinstance(node, Command):
            return self._command(node, source, shell)
        if isinstance(node, Chain):
            self._chain(node, source, shell)
        elif isinstance(node, If):
            self._if(node, source, shell)
        elif isinstance(node, Case):
            self._case(node, source, shell)
        elif isinstance(node, Loop):
            body = node.body
            if node.variable:  # its value is only known inside the loop
                self._alternatives(shell, [node.header + body], source, loop=node.variable)
            else:
                self._alternatives(shell, [node.header + body], source)
        elif isinstance(node, Group):
            self._walk(node.body, source, shell.copy() if node.subshell else shell)
        else:
            shell.functions[node.name] = (node, source)
        return True

    def _alternatives(
        self,
        shell: Shell,
        bodies: list[tuple[Node, ...]],
        source: Source,
        *,
        keep: bool = True,
        loop: str = "",
    ) -> None:
        """Walk each body on a copy of the variables and merge; `keep`: running none of them
        is possible too."""
        results = []
        for body in bodies:
            copy = shell.copy()
            if loop:
                copy.env[loop] = Var(Text.unknown(f"${loop}", "a loop variable"))
            self._walk(body, source, copy)
            results.append(copy)
        if keep:
            results.append(shell.copy())
        _merge(shell, results)

    def _chain(self, node: Chain, source: Source, shell: Shell) -> None:
        if node.background or any(op in {"|", "|&"} for op in node.ops):
            for item in node.items:  # pipelines and background jobs run in subshells
                self._node(item, source, shell.copy())
            return
        truth = self._node(node.items[0], source, shell)
        for op, item in zip(node.ops, node.items[1:], strict=True):
            if truth is None:
                self._alternatives(shell, [(item,)], source)
            elif truth is (op == "&&"):
                truth = self._node(item, source, shell)

    def _if(self, node: If, source: Source, shell: Shell) -> None:
        for index, (condition, body) in enumerate(node.clauses):
            truth: bool | None = None
            for part in condition:
                truth = self._node(part, source, shell)
            if truth is True:
                self._walk(body, source, shell)
                return
            if truth is None:
                bodies = [body, *(later for _, later in node.clauses[index + 1 :])]
                if node.orelse is not None:
                    bodies.append(node.orelse)
                self._alternatives(shell, bodies, source, keep=node.orelse is None)
                return
        if node.orelse is not None:
            self._walk(node.orelse, source, shell)

    def _case(self, node: Case, source: Source, shell: Shell) -> None:
        subject = self._expand_single(node.subject, source, shell) if node.subject else None
        if subject is not None and not subject.opaque:
            for item in node.items:
                for pattern in item.patterns:
                    text = self._expand_single(pattern, source, shell)
                    if not text.opaque and fnmatch.fnmatchcase(subject.plain, text.plain):
                        self._walk(item.body, source, shell)
                        return
            return
        self._alternatives(shell, [item.body for item in node.items], source)

    # ------------------------------------------------------------ simple commands

    def _command(self, node: Command, source: Source, shell: Shell) -> bool | None:
        prefix = [
            assignment
            for word in node.assignments
            if (assignment := self._assignment(word, source, shell)) is not None
        ]
        fields = self._expand_words(node.words, source, shell)
        if not node.words:
            for name, var, append in prefix:
                _assign(shell, name, var, append)
            return True
        program = fields[0].plain if fields else ""
        if program in _DECLARE:
            self._declare(node, fields, source, shell)
            return True
        if program == "read":
            self._read(node, fields, source, shell)
            return True
        if program in {"cd", "pushd", "popd"}:
            self._cd(program, fields, shell)
            return True
        if program in {"[", "[[", "test", "true", "false", ":"}:
            return _test(fields)
        if program == "unset":
            for field_ in fields[1:]:
                shell.env.forget(field_.plain)
            return True
        if program == "shift" or (program == "set" and "--" in (f.plain for f in fields[1:2])):
            shell.positional = None
            return True
        if self._writes_file(node, fields, source, shell):
            return True
        local = shell
        if prefix:  # `A=1 cmd`: A is set for cmd only
            local = Shell(
                Env(shell.env), shell.positional, shell.functions, shell.cwd, shell.wrappers
            )
            for name, var, append in prefix:
                previous = local.env.get(name)
                value = (previous.value + var.value) if append and previous else var.value
                local.env[name] = replace(var, value=value, exported=True)
        anchor = Anchor(source.file, node.start)
        if source.mapped is not None and self.outer is not None:
            anchor = self.outer  # a command inside a string: the line that runs the string
        ends = ArgsEnd(source, _word_end(node.words[-1]))
        self._dispatch(fields, local, anchor, ends, source)
        if local is not shell and program in _SOURCE:  # a sourced file changes this shell
            prefixed = {name for name, _, _ in prefix}
            for name in local.env.changed - prefixed:
                if name in local.env:
                    shell.env[name] = local.env[name]
            shell.cwd = local.cwd
        return True

    def _dispatch(
        self, fields: list[Text], shell: Shell, anchor: Anchor, ends: ArgsEnd, source: Source
    ) -> None:
        """Find what a command runs: another shell's code, a function, or a launcher."""
        if not fields or posixpath.basename(fields[0].plain) in NOT_LAUNCHERS:
            return
        for index, current in enumerate(fields):
            word = current.plain
            base = posixpath.basename(word)
            rest = fields[index + 1 :]
            if index == 0 and word in shell.functions:
                self._function(word, rest, shell)
                return
            if index == 0 and word == "eval" and rest:
                self.run_string(join(rest), shell, anchor)
                return
            if base in _SHELLS and rest:
                self._shell(
                    rest, shell, anchor, ends, source=source, wrappers=tuple(fields[: index + 1])
                )
                return
            if word in _SOURCE and rest:
                self._script(rest[0], rest[1:], shell, anchor, ends, sourced=True)
                return
            if word.endswith((".sh", ".bash")) and not word.startswith("-"):
                if not any(
                    _is_launcher(posixpath.basename(f.plain), fields[i + 1 :])
                    for i, f in enumerate(fields)
                    if i > index
                ):
                    self._script(current, rest, shell, anchor, ends, sourced=False)
                    return
                continue  # a wrapper that runs its arguments (run_with_env.sh python ...)
            if _is_launcher(base, rest):
                self.calls += 1
                if self.calls > MAX_CALLS:
                    if self.calls == MAX_CALLS + 1:
                        self.notes.append(f"only the first {MAX_CALLS} launch commands are read")
                    return
                self.on_call(
                    Call(
                        fields=tuple(fields[index:]),
                        before=shell.wrappers + tuple(fields[:index]),
                        env={k: v for k, v in shell.env.items() if v.exported},
                        unexported=frozenset(k for k, v in shell.env.items() if not v.exported),
                        anchor=anchor,
                        args_end=ends,
                        cwd=shell.cwd,
                        virtual=dict(self.virtual),
                    )
                )
                return

    def _shell(
        self,
        rest: list[Text],
        shell: Shell,
        anchor: Anchor,
        ends: ArgsEnd,
        *,
        source: Source,
        wrappers: tuple[Text, ...],
    ) -> None:
        """`bash [-opts] -c STRING [$0 args...]` or `bash FILE args`."""
        index = 0
        command = False
        while index < len(rest) and rest[index].plain.startswith("-"):
            flag = rest[index].plain
            command = command or (
                flag.startswith("-") and not flag.startswith("--") and "c" in flag
            )
            index += 1
            if command:
                break
        if index >= len(rest):
            return
        if command:
            arguments = tuple(rest[index + 2 :])
            child = shell.child(arguments, wrappers + tuple(rest[:index]))
            self.run_string(rest[index], child, anchor)
            return
        self._script(rest[index], rest[index + 1 :], shell, anchor, ends, sourced=False)

    def _script(
        self,
        path: Text,
        arguments: list[Text],
        shell: Shell,
        anchor: Anchor,
        ends: ArgsEnd,
        *,
        sourced: bool,
    ) -> None:
        plain = path.plain
        if sourced and (path.opaque or any(mark in plain for mark in _NOT_WRAPPERS)):
            return
        if sourced and not plain.endswith((".sh", ".bash")):
            return
        resolved = resolve(path, shell.cwd)
        text = self.files.get(resolved) if resolved is not None else None
        if text is None and resolved is not None and resolved in self.virtual:
            text = self.virtual[resolved].plain
        if text is None:
            self.on_missing(Missing(path, resolved, tuple(arguments), anchor, sourced, ends))
            return
        if resolved is not None and resolved not in self.files_read:
            self.files_read.append(resolved)
        positional = tuple(arguments) if arguments or not sourced else shell.positional
        if sourced:
            saved = shell.positional
            shell.positional = positional
            self.run_file(resolved or plain, text, shell)
            shell.positional = saved
        else:
            self.run_file(resolved or plain, text, shell.child(positional, (path,)))

    def _function(self, name: str, arguments: list[Text], shell: Shell) -> None:
        node, source = shell.functions[name]
        if not self._enter(0, f"function {name}: not followed (nesting limit)"):
            return
        saved = shell.positional
        shell.positional = tuple(arguments)
        try:
            self._walk(node.body, source, shell)
        finally:
            shell.positional = saved
            self.depth -= 1

    def _declare(self, node: Command, fields: list[Text], source: Source, shell: Shell) -> None:
        """export/declare/readonly/local: assignments among the arguments, `-x` exports."""
        program = fields[0].plain
        exported = program == "export"
        for word in node.words[1:]:
            raw = source.text[word.start : word.end]
            if raw.startswith("-"):
                exported = exported or "x" in raw.lstrip("-")
                continue
            assignment = self._assignment(word, source, shell)
            if assignment is not None:
                name, var, append = assignment
                _assign(shell, name, replace(var, exported=exported), append)
            elif _NAME.match(raw) and exported and raw in shell.env:
                shell.env[raw] = replace(shell.env[raw], exported=True)

    def _read(self, node: Command, fields: list[Text], source: Source, shell: Shell) -> None:
        """`read -r -d '' X <<EOF` keeps the body; `read -ra X <<< "$Y"` splits Y; any other
        read is run-time input."""
        names = [f.plain for f in fields[1:] if _NAME.match(f.plain)]
        array = any(f.plain.startswith("-") and "a" in f.plain for f in fields[1:])
        if not names:
            return
        body: Text | None = None
        for redirect in node.redirects:
            if redirect.heredoc is not None:
                body = self._heredoc(redirect.heredoc, source, shell)
            elif redirect.op == "<<<" and redirect.target is not None:
                body = self._expand_single(redirect.target, source, shell)
        name = names[-1]
        if body is None or (body.opaque and array):
            shell.env[name] = Var(Text.unknown(f"${name}", "read at run time"))
        elif array:
            items, _, _ = body.split_blanks()
            shell.env[name] = Var(items[0] if items else Text(), tuple(items))
        else:
            shell.env[name] = Var(body.strip())

    def _cd(self, program: str, fields: list[Text], shell: Shell) -> None:
        if program == "popd" or len(fields) < 2:
            shell.cwd = None if program == "popd" else Text()
            return
        target = fields[1]
        if target.opaque:
            shell.cwd = None
        elif target.plain.startswith("/"):
            shell.cwd = target
        elif shell.cwd is not None:
            shell.cwd = Text.derived(
                posixpath.normpath(posixpath.join(shell.cwd.plain, target.plain))
            )

    def _writes_file(self, node: Command, fields: list[Text], source: Source, shell: Shell) -> bool:
        """`cat <<EOF > FILE` (or `tee FILE <<EOF`): remember FILE's content."""
        heredoc = next((r.heredoc for r in node.redirects if r.heredoc is not None), None)
        if heredoc is None or not fields or fields[0].plain not in {"cat", "tee"}:
            return False
        target: Text | None = None
        for redirect in node.redirects:
            if redirect.op in {">", ">>", ">|"} and redirect.target is not None:
                target = self._expand_single(redirect.target, source, shell)
        if target is None and fields[0].plain == "tee" and len(fields) > 1:
            target = fields[-1]
        if target is None:
            return False
        path = resolve(target, shell.cwd)
        key = path if path is not None else target.plain
        self.virtual[key] = self._heredoc(heredoc, source, shell)
        return True

    def _heredoc(self, heredoc: Heredoc, source: Source, shell: Shell) -> Text:
        if heredoc.quoted:
            return source.chars(heredoc.start, heredoc.body_end, Form.HEREDOC_LITERAL)
        pieces = self._parts(heredoc.parts, source, shell, context=Form.HEREDOC)
        return join((piece.text for piece in pieces), "")

    # ------------------------------------------------------------ expansion

    def _assignment(self, word: Word, source: Source, shell: Shell) -> tuple[str, Var, bool] | None:
        """`NAME=value`, `NAME+=value`, `NAME=(a b c)`: no field splitting for scalars; None
        for a word that only looks like one (`X[$i]=v`)."""
        first = word.parts[0]
        if first.kind is PartKind.ARRAY:
            match = _ASSIGNMENT.match(first.name)
            if match is None:
                return None
            items: list[Text] = []
            for element in first.elements:
                items.extend(self._expand_word(element, source, shell))
            value = items[0] if items else Text()
            return match.group("name"), Var(value, tuple(items)), match.group("op") == "+="
        raw = source.text[first.start : first.end]
        match = _ASSIGNMENT.match(raw) if first.kind is PartKind.LITERAL else None
        if match is None:
            return None
        rest_start = first.start + match.end()
        parts = (Part(PartKind.LITERAL, rest_start, first.end), *word.parts[1:])
        pieces = self._parts(parts, source, shell, context=Form.SHELL_WORD)
        value = join((piece.text for piece in pieces), "")
        if match.group("index") is not None:
            name = match.group("name")
            previous = shell.env.get(name)
            items = list(previous.items) if previous and previous.items else []
            return name, Var(previous.value if previous else value, tuple(items)), False
        return match.group("name"), Var(value), match.group("op") == "+="

    def _expand_words(self, words: tuple[Word, ...], source: Source, shell: Shell) -> list[Text]:
        fields: list[Text] = []
        for word in words:
            fields.extend(self._expand_word(word, source, shell))
        return fields

    def _expand_single(self, word: Word, source: Source, shell: Shell) -> Text:
        pieces = self._parts(word.parts, source, shell, context=Form.SHELL_WORD)
        return join((piece.text for piece in pieces), "")

    def _expand_word(self, word: Word, source: Source, shell: Shell) -> list[Text]:
        """A word's fields: unquoted expansions split at blanks, "$@"-like ones into many."""
        fields: list[Text] = []
        current = Text()
        started = False
        for piece in self._parts(word.parts, source, shell, context=Form.SHELL_WORD):
            if piece.brk:
                if started:
                    fields.append(current)
                current, started = Text(), False
                continue
            if not piece.split:
                current = current + piece.text
                started = started or piece.quoted or bool(piece.text)
                continue
            parts, leading, trailing = piece.text.split_blanks()
            if leading and started:
                fields.append(current)
                current, started = Text(), False
            for index, part in enumerate(parts):
                if index:
                    fields.append(current)
                    current = Text()
                current = current + part
                started = True
            if trailing and parts:
                fields.append(current)
                current, started = Text(), False
        if started:
            fields.append(current)
        return fields

    def _parts(
        self, parts: tuple[Part, ...], source: Source, shell: Shell, context: Form
    ) -> list[_Piece]:
        """Expand parts into pieces; `context` is the quoting they sit in."""
        pieces: list[_Piece] = []
        quoted = context is not Form.SHELL_WORD
        text_form = context if quoted else Form.SHELL_WORD
        for part in parts:
            kind = part.kind
            if kind in {PartKind.LITERAL, PartKind.QUOTED_TEXT}:
                pieces.append(_Piece(source.chars(part.start, part.end, text_form), quoted=quoted))
            elif kind in {PartKind.ESCAPE, PartKind.QUOTED_ESCAPE}:
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
                children = self._parts(part.children, source, shell, context=Form.DOUBLE_QUOTED)
                if not children:
                    pieces.append(_Piece(Text(), quoted=True))
                pieces.extend(children)
            elif kind is PartKind.PARAM:
                pieces.extend(self._param(part, source, shell, context))
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

    def _param(self, part: Part, source: Source, shell: Shell, context: Form) -> list[_Piece]:
        quoted = context is not Form.SHELL_WORD
        form = context if quoted else Form.SHELL_WORD
        expression = source.text[part.start : part.end]
        place = source.place(part.start, form)

        def unknown(why: str) -> Text:
            return Text.unknown(expression, why, place)

        def through(value: Text) -> Text:
            if place is None or not value:
                return value
            file, start, where = place
            return value.through(file, start, start + len(expression), where or form)

        name, op = part.name, part.op
        if name in {"@", "*"}:
            if shell.positional is None:
                return [_Piece(unknown("the script's arguments"), split=not quoted, quoted=quoted)]
            return self._many(list(shell.positional), name == "@" and quoted, quoted, through)
        if part.index in {"@", "*"} and op == "":
            var = shell.env.get(name)
            if var is None:
                return [_Piece(unknown("not set in the script"), split=not quoted, quoted=quoted)]
            items = list(var.items) if var.items is not None else [var.value]
            return self._many(items, part.index == "@" and quoted, quoted, through)
        if op in {"len", "other"}:
            return [_Piece(unknown("computed at run time"), split=not quoted, quoted=quoted)]
        value = self._lookup(name, part.index, shell)
        if value is None and op and name in SLURM_JOB_VARIABLES:
            value = unknown(_unset_why(name))  # `${SLURM_NNODES:-1}`: the default is never used
        is_set = value is not None and (not op.startswith(":") or value.opaque or bool(value))
        if op == "":
            result = through(value) if value is not None else unknown(_unset_why(name))
        elif op in {"-", ":-", "=", ":="}:
            if is_set and value is not None:
                result = through(value)
            else:
                default = self._operand(part, source, shell, context)
                if op in {"=", ":="} and _NAME.match(name):
                    _assign(shell, name, Var(default), append=False)
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
            result = self._operand(part, source, shell, context) if is_set else Text()
        return [_Piece(result, split=not quoted, quoted=quoted)]

    def _many(
        self, items: list[Text], separate: bool, quoted: bool, through: Callable[[Text], Text]
    ) -> list[_Piece]:
        if not separate:
            return [_Piece(through(join(items)), split=not quoted, quoted=quoted)]
        pieces: list[_Piece] = []
        for index, item in enumerate(items):
            if index:
                pieces.append(_Piece(Text(), brk=True))
            pieces.append(_Piece(through(item), quoted=True))
        return pieces

    def _operand(self, part: Part, source: Source, shell: Shell, context: Form) -> Text:
        pieces = self._parts(part.children, source, shell, context)
        return join((piece.text for piece in pieces), "")

    def _lookup(self, name: str, index: str, shell: Shell) -> Text | None:
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
            if index.isdigit() and int(index) < len(var.items):
                return var.items[int(index)]
            return Text.unknown(f"${{{name}[{index}]}}", "an array element chosen at run time")
        return var.value


# Set by sbatch in every batch job (sbatch(1), OUTPUT ENVIRONMENT VARIABLES), whatever the
# directives say: a default written for one of them is never what the job reads.
SLURM_JOB_VARIABLES = frozenset(
    {
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_JOB_NAME",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_SUBMIT_DIR",
        "SLURM_SUBMIT_HOST",
        "SLURM_CLUSTER_NAME",
        "SLURM_JOB_PARTITION",
        "SLURM_JOB_CPUS_PER_NODE",
        "SLURM_NODEID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    }
)


@dataclass(frozen=True)
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


def _assign(shell: Shell, name: str, var: Var, append: bool) -> None:
    previous = shell.env.get(name)
    if append and previous is not None:
        if var.items is not None:
            items = (previous.items or (previous.value,)) + var.items
            var = Var(items[0], items, previous.exported or var.exported)
        else:
            var = Var(previous.value + var.value, None, previous.exported or var.exported)
    elif previous is not None and previous.exported:
        var = replace(var, exported=True)
    shell.env[name] = var


def _merge(shell: Shell, results: list[Shell]) -> None:
    """After branches the script cannot choose between: a variable they left different
    becomes opaque, pointing at the first assignment that differs."""
    names: set[str] = set()
    for result in results:
        names |= result.env.changed
    for name in names:
        values = [result.env.get(name) for result in results]
        first = values[0]
        if all(_same(first, value) for value in values[1:]):
            if first is None:
                shell.env.forget(name)
            else:
                shell.env[name] = first
            continue
        differing = next(
            (v for v in values if v is not None and not _same(v, shell.env.get(name))), None
        )
        file, start, form, span = None, 0, None, -1
        if differing is not None and differing.value.segs:
            seg = differing.value.segs[0]
            if seg.file is not None:
                file, start, form = seg.file, seg.start, seg.form
                span = written_length(seg) if seg.opaque else len(seg.text)
        why = "depends on a condition the script tests at run time"
        exported = any(value is not None and value.exported for value in values)
        unknown = Seg(
            f"${name}",
            file,
            start,
            form,
            opaque=True,
            why=why,
            span=span,
            frames=_candidates(shell.env.get(name), values),
        )
        shell.env[name] = Var(Text((unknown,)), None, exported)
    for result in results:
        for function, definition in result.functions.items():
            shell.functions.setdefault(function, definition)
    cwds = {None if r.cwd is None else r.cwd.plain for r in results}
    shell.cwd = results[0].cwd if len(cwds) == 1 else None


def _candidates(before: Var | None, values: list[Var | None]) -> tuple[Frame, ...]:
    """Where each value a variable may have is assigned: kept as frames that never mark an
    end of arguments (`last` is -2), so a report can name every line the value may come from."""
    frames: list[Frame] = []
    for value in (before, *values):
        segs = value.value.segs if value is not None else ()
        seg = next((s for s in segs if s.file is not None), None)
        if seg is None or seg.file is None or seg.form is None:
            continue
        length = written_length(seg) if seg.opaque else len(seg.text)
        frame = Frame(seg.file, seg.start, seg.start + length, seg.form, 0, -2)
        if frame not in frames:
            frames.append(frame)
    return tuple(frames[:MAX_FRAMES])


def _same(first: Var | None, second: Var | None) -> bool:
    if first is None or second is None:
        return first is second
    return first.value.segs == second.value.segs and first.items == second.items


def _test(fields: list[Text]) -> bool | None:
    """The exit status of `[ ... ]`, `[[ ... ]]`, `test`, `true`, `false`, `:` when the script
    decides it: string tests on values it wrote, integer comparisons."""
    program = fields[0].plain
    if program in {"true", ":"}:
        return True
    if program == "false":
        return False
    arguments = fields[1:]
    if program in {"[", "[["} and arguments and arguments[-1].plain in {"]", "]]"}:
        arguments = arguments[:-1]
    if any(argument.opaque for argument in arguments):
        return None
    words = [argument.plain for argument in arguments]
    negate = False
    if words and words[0] == "!":
        negate, words = True, words[1:]
    result: bool | None = None
    if len(words) == 1:
        result = bool(words[0])
    elif len(words) == 2 and words[0] in _TEST_UNARY:
        result = _TEST_UNARY[words[0]](words[1])
    elif len(words) == 3 and words[1] in {"=", "=="}:
        glob = program == "[[" and words[1] == "=="
        result = fnmatch.fnmatchcase(words[0], words[2]) if glob else words[0] == words[2]
    elif len(words) == 3 and words[1] == "!=":
        result = words[0] != words[2]
    elif len(words) == 3 and words[1] in _TEST_INT:
        try:
            result = _TEST_INT[words[1]](int(words[0]), int(words[2]))
        except ValueError:
            result = None
    if result is None:
        return None
    return not result if negate else result


def _is_launcher(base: str, rest: list[Text]) -> bool:
    return launcher_kind(base, rest[0].plain if rest else "") is not None


def _word_end(word: Word) -> int:
    """Where a word's text ends, before a backslash-newline glued to it (`16\\`)."""
    end = word.end
    for part in reversed(word.parts):
        if part.kind is not PartKind.CONTINUATION:
            break
        end = part.start
    return end


def _ansi_c(raw: str) -> str:
    escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "a": "\a", "r": "\r"}
    return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), "\\" + m.group(1)), raw)


def resolve(path: Text, cwd: Text | None) -> str | None:
    """A path as the job would open it, relative to the submit directory; None when part of
    it is only known at run time (a working directory `$(pwd)` counts as known)."""
    segs = list(path.segs)
    prefix = ""
    if segs and segs[0].opaque and segs[0].why == WORKDIR:
        if cwd is None:
            return None
        prefix = cwd.plain or "."
        segs = segs[1:]
    rest = Text(segs)
    if rest.opaque:
        return None
    plain = prefix + rest.plain
    if plain.startswith("~"):
        return None
    if not plain.startswith("/") and not prefix:
        if cwd is None:
            return None
        plain = posixpath.join(cwd.plain, plain) if cwd.plain else plain
    return posixpath.normpath(plain) if plain else None
