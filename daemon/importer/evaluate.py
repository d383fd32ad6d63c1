"""Walks a script the way bash would up to each launch, without running anything.

What each word is comes from `expansion` (variables hold `Text`s that keep where they were
written; `$1`, the environment, `$(cmd)` stay opaque). This decides which commands run: branches
whose condition can be decided from the script itself (`[ -n "$X" ]` with X assigned above,
`case` on a known word) are taken or skipped like bash would; other branches are each walked on
a copy of the variables and a variable they leave different becomes opaque ("depends on a
condition").

Commands that run other shell code are followed: `bash -c STRING`, `bash FILE`, `source FILE`,
`./script.sh`, functions. Commands that start a training program are handed to the caller as
`Call`s; files the script writes with a here-document (`cat <<EOF > ds.json`) are kept as
virtual files. Work is bounded: nesting depth, commands walked, characters re-read, what
references copy (`expansion.Work`) and glob tests decided; and no step costs what the script has
read so far (a branch's copy of the variables, a launch's view of the environment and of the
files written) or the rest of a command's words. The walk stays one piece of some 700 lines:
its node and command handlers recurse into each other (a function body, `bash -c`, a sourced
file) under one set of bounds.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from daemon.importer.expansion import (
    NAME,
    WORKDIR,
    Shell,
    Source,
    Var,
    assign,
    expand_heredoc,
    expand_single,
    expand_word,
    expand_words,
    read_assignment,
)
from daemon.importer.lexer import Part, PartKind, Word
from daemon.importer.shell import (
    Case,
    Chain,
    Command,
    Group,
    If,
    Loop,
    Node,
    statements,
)
from daemon.importer.values import MAX_FRAMES, Frame, Seg, Text, join, written_length
from daemon.importer.vocabulary import (
    ALLOC_CONF_VARIABLES,
    LIGHTNING_DEEPSPEED_VARIABLE,
    NOT_LAUNCHERS,
    launcher_kind,
)

MAX_SHELL_DEPTH = 8  # bash -c inside a wrapper inside a function...: real scripts use 3
MAX_COMMANDS = 20_000  # commands walked per analysis (a script has a few hundred)
MAX_REREAD_CHARS = 4_000_000  # characters re-tokenized for nested strings and files, in all
MAX_CALLS = 256  # launch commands read per analysis (a script has one or two)
MAX_GLOB_TESTS = 2_000  # `case` patterns and `[[ x == pattern ]]` decided (each compiles one)
MAX_GLOB_CHARS = 1_024  # longer patterns or subjects are not decided
# The variables the analysis reads at a launch: what `Call.env` holds (copying every exported
# variable for each of 256 launches was quadratic in a script of many exports).
LAUNCH_VARIABLES = (*ALLOC_CONF_VARIABLES, LIGHTNING_DEEPSPEED_VARIABLE)

_OPAQUE_MASK = "\x01"  # stands for a run-time value inside a string read again as code
_SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh"})
_SOURCE = frozenset({"source", "."})
_DECLARE = frozenset({"export", "declare", "typeset", "local", "readonly"})
_NOT_WRAPPERS = ("activate", ".bashrc", ".bash_profile", ".profile", ".env", "/etc/", "env.sh")
# Programs whose arguments the walk never reads (no launcher, no file written or state changed):
# their words past the first need not be expanded.
_INERT = NOT_LAUNCHERS - {
    *("cd", "pushd", "popd", "[", "[[", "test", "true", "false", ":"),
    *("unset", "shift", "set", "cat", "tee", "read", "eval", "source", "."),
}
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
    env: Mapping[str, Var]  # those of LAUNCH_VARIABLES the launched process sees (exported)
    unexported: frozenset[str]  # those of LAUNCH_VARIABLES assigned but not exported here
    anchor: Anchor
    args_end: ArgsEnd
    cwd: Text | None
    virtual: Mapping[str, Text]  # the files written so far: a view, read during `on_call`


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
        self.globs = 0

    # ------------------------------------------------------------ entry points

    def run_file(self, file: str, text: str, shell: Shell) -> None:
        if not self._enter(len(text), f"{file}: not followed (nesting or size limit)"):
            return
        outer, self.outer = self.outer, None  # a file's commands are anchored in the file
        try:
            source = Source(file, text)
            for nodes in statements(text):  # walked as read: never the whole script's nodes
                self._walk(nodes, source, shell)
                if self.commands > MAX_COMMANDS:
                    break  # the walk has stopped: the rest is not even read
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
            for nodes in statements(masked):
                self._walk(nodes, source, shell)
                if self.commands > MAX_COMMANDS:
                    break
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
        subject = expand_single(node.subject, source, shell) if node.subject else None
        if subject is not None and not subject.opaque:
            for index, item in enumerate(node.items):
                for pattern in item.patterns:
                    text = expand_single(pattern, source, shell)
                    matched = None if text.opaque else self._glob(subject.plain, text.plain)
                    if matched is None:  # only known at run time from here on
                        bodies = [later.body for later in node.items[index:]]
                        self._alternatives(shell, bodies, source)
                        return
                    if matched:
                        self._walk(item.body, source, shell)
                        return
            return
        self._alternatives(shell, [item.body for item in node.items], source)

    def _glob(self, subject: str, pattern: str) -> bool | None:
        """Whether `subject` matches the glob `pattern`; None when it is not decided: too long
        a pattern or subject, or past MAX_GLOB_TESTS (each compiles an expression; fnmatch's
        own cache of 32,768 would keep a hostile script's patterns in the daemon)."""
        if len(pattern) > MAX_GLOB_CHARS or len(subject) > MAX_GLOB_CHARS:
            return None
        self.globs += 1
        if self.globs > MAX_GLOB_TESTS:
            return None
        return re.match(fnmatch.translate(pattern), subject) is not None

    # ------------------------------------------------------------ simple commands

    def _command(self, node: Command, source: Source, shell: Shell) -> bool | None:
        prefix = [
            assignment
            for word in node.assignments
            if (assignment := read_assignment(word, source, shell)) is not None
        ]
        fields = expand_word(node.words[0], source, shell) if node.words else []
        if fields and fields[0].plain in _INERT and not any(_assigns(w.parts) for w in node.words):
            return True  # `echo ...`: its arguments change nothing, they are not expanded
        fields += expand_words(node.words[1:], source, shell)
        if not node.words:
            for name, var, append in prefix:
                assign(shell, name, var, append)
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
            return _test(fields, self._glob)
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
                shell.env.overlay(),
                shell.positional,
                shell.functions,
                shell.cwd,
                shell.wrappers,
                shell.work,
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
        # Whether a launcher comes after each field, from the end: a wrapper script runs its
        # arguments when one does. (Asking again for each field, and slicing the rest of the
        # fields for each, was quadratic in a command of many words.)
        launcher_after = [False] * (len(fields) + 1)
        for index in range(len(fields) - 1, -1, -1):
            following = fields[index + 1 : index + 2]
            launcher_after[index] = launcher_after[index + 1] or _is_launcher(
                posixpath.basename(fields[index].plain), following
            )
        for index, current in enumerate(fields):
            word = current.plain
            base = posixpath.basename(word)
            following = fields[index + 1 : index + 2]
            if not (
                (index == 0 and word in shell.functions)
                or (index == 0 and word == "eval" and following)
                or (base in _SHELLS and following)
                or (word in _SOURCE and following)
                or (word.endswith((".sh", ".bash")) and not word.startswith("-"))
                or _is_launcher(base, following)
            ):
                continue
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
                if not launcher_after[index + 1]:
                    self._script(current, rest, shell, anchor, ends, sourced=False)
                    return
                continue  # a wrapper that runs its arguments (run_with_env.sh python ...)
            if _is_launcher(base, rest):
                self.calls += 1
                if self.calls > MAX_CALLS:
                    if self.calls == MAX_CALLS + 1:
                        self.notes.append(f"only the first {MAX_CALLS} launch commands are read")
                    return
                known = {name: var for name in LAUNCH_VARIABLES if (var := shell.env.get(name))}
                self.on_call(
                    Call(
                        fields=tuple(fields[index:]),
                        before=shell.wrappers + tuple(fields[:index]),
                        env={name: var for name, var in known.items() if var.exported},
                        unexported=frozenset(n for n, var in known.items() if not var.exported),
                        anchor=anchor,
                        args_end=ends,
                        cwd=shell.cwd,
                        virtual=MappingProxyType(self.virtual),
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
            if not sourced:  # read as a launch: counted like one
                self.calls += 1
                if self.calls > MAX_CALLS:
                    if self.calls == MAX_CALLS + 1:
                        self.notes.append(f"only the first {MAX_CALLS} launch commands are read")
                    return
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
            assignment = read_assignment(word, source, shell)
            if assignment is not None:
                name, var, append = assignment
                assign(shell, name, replace(var, exported=exported), append)
            elif NAME.match(raw) and exported and raw in shell.env:
                shell.env[raw] = replace(shell.env[raw], exported=True)

    def _read(self, node: Command, fields: list[Text], source: Source, shell: Shell) -> None:
        """`read -r -d '' X <<EOF` keeps the body; `read -ra X <<< "$Y"` splits Y; any other
        read is run-time input."""
        names = [f.plain for f in fields[1:] if NAME.match(f.plain)]
        array = any(f.plain.startswith("-") and "a" in f.plain for f in fields[1:])
        if not names:
            return
        body: Text | None = None
        for redirect in node.redirects:
            if redirect.heredoc is not None:
                body = expand_heredoc(redirect.heredoc, source, shell)
            elif redirect.op == "<<<" and redirect.target is not None:
                body = expand_single(redirect.target, source, shell)
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
                target = expand_single(redirect.target, source, shell)
        if target is None and fields[0].plain == "tee" and len(fields) > 1:
            target = fields[-1]
        if target is None:
            return False
        path = resolve(target, shell.cwd)
        key = path if path is not None else target.plain
        self.virtual[key] = expand_heredoc(heredoc, source, shell)
        return True


def _merge(shell: Shell, results: list[Shell]) -> None:
    """After branches the script cannot choose between: a variable they left different
    becomes opaque, pointing at the first assignment that differs. Costs what the branches
    changed: a branch that did not assign a name leaves it as it was (`shell`'s)."""
    changed_in: dict[str, list[int]] = {}
    for index, result in enumerate(results):
        for name in result.env.changed:
            changed_in.setdefault(name, []).append(index)
    for name, indices in changed_in.items():
        before = shell.env.get(name)
        changed = [results[index].env.get(name) for index in indices]
        unchanged = len(indices) < len(results)  # a branch left it as it was
        first = changed[0] if indices[0] == 0 else before
        if all(_same(first, value) for value in changed) and (
            not unchanged or _same(first, before)
        ):
            if first is None:
                shell.env.forget(name)
            else:
                shell.env[name] = first
            continue
        differing = next((v for v in changed if v is not None and not _same(v, before)), None)
        file, start, form, span = None, 0, None, -1
        if differing is not None and differing.value.segs:
            seg = differing.value.segs[0]
            if seg.file is not None:
                file, start, form = seg.file, seg.start, seg.form
                span = written_length(seg) if seg.opaque else len(seg.text)
        why = "depends on a condition the script tests at run time"
        values = [*changed, before] if unchanged else changed
        exported = any(value is not None and value.exported for value in values)
        unknown = Seg(
            f"${name}",
            file,
            start,
            form,
            opaque=True,
            why=why,
            span=span,
            frames=_candidates(before, changed),
        )
        shell.env[name] = Var(Text((unknown,)), None, exported)
    for result in results:
        for function, definition in result.functions.maps[0].items():
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
            if len(frames) == MAX_FRAMES:  # a `case` of 10,000 branches: enough to name
                break
    return tuple(frames)


def _same(first: Var | None, second: Var | None) -> bool:
    if first is None or second is None:
        return first is second
    return first.value.segs == second.value.segs and first.items == second.items


def _test(fields: list[Text], glob: Callable[[str, str], bool | None]) -> bool | None:
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
        if program == "[[" and words[1] == "==":
            result = glob(words[0], words[2])
        else:
            result = words[0] == words[2]
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


def _assigns(parts: tuple[Part, ...]) -> bool:
    """Whether expanding these parts assigns a variable (`${X:=default}`, `${X=default}`)."""
    for part in parts:
        if part.kind is PartKind.PARAM and part.op in {"=", ":="}:
            return True
        if part.children and _assigns(part.children):
            return True
        if part.elements and any(_assigns(element.parts) for element in part.elements):
            return True
    return False


def _word_end(word: Word) -> int:
    """Where a word's text ends, before a backslash-newline glued to it (`16\\`)."""
    end = word.end
    for part in reversed(word.parts):
        if part.kind is not PartKind.CONTINUATION:
            break
        end = part.start
    return end


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
