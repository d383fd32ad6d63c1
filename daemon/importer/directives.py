"""The #SBATCH header as sbatch reads it, with the span of every value.

sbatch reads lines that start with `#SBATCH` (or the old `#SLURM`) in column 0, and stops at
the first line that is neither blank nor a comment (Slurm's `_opt_batch_script`). Its own
argument splitter groups quoted text, honours backslashes and ends a line at an unquoted `#`
(`_get_argument`), and getopt takes `--opt=value`, `--opt value`, `-N 2`, `-N2` and unambiguous
prefixes of long names (`--err`). `#SBATCH hetjob` (`packjob`) starts the next component of a
heterogeneous job. Look-alikes Slurm ignores (`# SBATCH`, `##SBATCH`, `#SBATCz`, directives
after the first command) are reported, not read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from daemon.importer.records import ImporterError

_MAGIC = ("#SBATCH", "#SLURM")
MAX_DIRECTIVES = 1_000  # options of one header (a real one has a dozen); more are refused
_LOOKALIKE = re.compile(r"[ \t]*#+[ \t]*SBATCH|[ \t]*#SBATC", re.IGNORECASE)
_SHORT = {
    "N": "nodes",
    "n": "ntasks",
    "c": "cpus-per-task",
    "G": "gpus",
    "J": "job-name",
    "t": "time",
    "p": "partition",
    "o": "output",
    "e": "error",
    "A": "account",
    "q": "qos",
    "w": "nodelist",
    "x": "exclude",
    "D": "chdir",
    "C": "constraint",
    "a": "array",
    "d": "dependency",
    "m": "distribution",
    "i": "input",
    "L": "licenses",
    "M": "clusters",
    "k": "no-kill",
    "s": "oversubscribe",
    "S": "core-spec",
    "F": "nodefile",
    "B": "extra-node-info",
    "b": "begin",
}
# Short options that take no value (getopt's flags): the next argument is an option.
_SHORT_FLAGS = frozenset("HIOQhkvVsW")
# Long options sbatch knows, for getopt's prefix matching; those without a value are flags.
_LONG_FLAGS = frozenset(
    {
        "exclusive",
        "overcommit",
        "requeue",
        "no-requeue",
        "contiguous",
        "hold",
        "wait",
        "test-only",
        "parsable",
        "quiet",
        "verbose",
        "use-min-nodes",
        "spread-job",
        "oversubscribe",
        "no-kill",
        "ignore-pbs",
        "reboot",
        "wrap",
    }
)
_LONG_VALUED = frozenset(
    {
        "nodes",
        "ntasks",
        "ntasks-per-node",
        "ntasks-per-socket",
        "ntasks-per-core",
        "ntasks-per-gpu",
        "cpus-per-task",
        "cpus-per-gpu",
        "gpus",
        "gpus-per-node",
        "gpus-per-task",
        "gpus-per-socket",
        "gres",
        "gres-flags",
        "gpu-bind",
        "gpu-freq",
        "job-name",
        "time",
        "time-min",
        "partition",
        "output",
        "error",
        "input",
        "account",
        "qos",
        "nodelist",
        "exclude",
        "chdir",
        "constraint",
        "array",
        "dependency",
        "distribution",
        "mem",
        "mem-per-cpu",
        "mem-per-gpu",
        "mem-bind",
        "mail-type",
        "mail-user",
        "reservation",
        "hint",
        "signal",
        "begin",
        "comment",
        "export",
        "licenses",
        "clusters",
        "wait-all-nodes",
        "switches",
        "tmp",
        "threads-per-core",
        "sockets-per-node",
        "cores-per-socket",
        "cpu-freq",
        "network",
        "nice",
        "priority",
        "profile",
        "propagate",
        "kill-on-invalid-dep",
        "open-mode",
        "deadline",
        "delay-boot",
        "mcs-label",
        "core-spec",
        "nodefile",
        "extra-node-info",
        "uid",
        "gid",
        "container",
        "acctg-freq",
        "bb",
        "bbf",
        "cluster-constraint",
        "mincpus",
        "prefer",
        "tres-per-task",
        "het-group",
    }
)
_PLACEHOLDER = re.compile(r"\?\?|\{\s*\w+\s*\}|<[A-Za-z_-]+>")


@dataclass(frozen=True)
class RawDirective:
    option: str  # canonical long name
    written: str  # the option as written (`-N`, `--nodes`)
    value: str
    value_start: int  # span of the value text in the file; -1 when it has no place
    value_end: int
    line_start: int
    group: int


@dataclass(frozen=True)
class Header:
    directives: tuple[RawDirective, ...]
    end: int  # offset of the first line that is not blank or a comment (sbatch stops there)
    after_last_directive: int  # offset of the line after the last directive (or the shebang)
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Argument:
    value: str
    start: int  # raw span
    end: int
    plain: bool  # no quotes or backslashes: the raw span is the value


def read_header(text: str) -> Header:
    directives: list[RawDirective] = []
    notes: list[str] = []
    group = 0
    position = 0
    header_end = len(text)
    after_last = 0
    reading = True
    for number, line in enumerate(_lines(text), start=1):
        line_start, position = position, position + len(line) + 1
        if not line.startswith(("#", " ", "\t")):  # most lines: no directive, no look-alike
            if reading and line.strip(" \t\r"):
                reading = False
                header_end = line_start
            continue
        if number == 1 and line.startswith("#!"):
            after_last = min(position, len(text))
            continue
        magic = next((word for word in _MAGIC if line.startswith(word)), None)
        if reading and magic is not None:
            arguments = _arguments(line, line_start)
            if any(arg.value.lower() in {"hetjob", "packjob"} for arg in arguments):
                group += 1
            directives.extend(_directives(arguments, line_start, group, number, notes))
            if len(directives) > MAX_DIRECTIVES:
                raise ImporterError(f"over {MAX_DIRECTIVES} #SBATCH options, not read")
            after_last = min(position, len(text))
            continue
        stripped = line.strip(" \t\r")
        if reading and stripped and not stripped.startswith("#"):
            reading = False
            header_end = line_start
        if _LOOKALIKE.match(line):
            why = "after the first command" if not reading else "not `#SBATCH` in column 0"
            if magic is None or not reading:
                notes.append(f"line {number}: {line.strip()!r} is not read by Slurm ({why})")
    return Header(tuple(directives), header_end, after_last, tuple(notes))


def _lines(text: str) -> Iterator[str]:
    """The lines of `text`, one at a time (a list of a million short lines is 60 MB)."""
    position = 0
    while True:
        newline = text.find("\n", position)
        if newline < 0:
            yield text[position:]
            return
        yield text[position:newline]
        position = newline + 1


def _arguments(line: str, line_start: int) -> list[_Argument]:
    """sbatch's `_get_argument` over a directive line: blank-separated, quotes group, `\\`
    escapes, an unquoted `#` ends the line. Spans are file offsets."""
    arguments: list[_Argument] = []
    text = line.rstrip("\r")
    cursor = next(len(word) for word in _MAGIC if text.startswith(word))
    while cursor < len(text):
        while cursor < len(text) and text[cursor] in " \t":
            cursor += 1
        if cursor >= len(text) or text[cursor] == "#":
            break
        start = cursor
        value: list[str] = []
        quote = ""
        plain = True
        while cursor < len(text) and (quote or text[cursor] not in " \t"):
            char = text[cursor]
            if char == "\\" and cursor + 1 < len(text):
                value.append(text[cursor + 1])
                cursor += 2
                plain = False
                continue
            if quote:
                if char == quote:
                    quote = ""
                else:
                    value.append(char)
            elif char in "\"'":
                quote = char
                plain = False
            elif char == "#":
                break
            else:
                value.append(char)
            cursor += 1
        arguments.append(_Argument("".join(value), line_start + start, line_start + cursor, plain))
        if len(arguments) > 2 * MAX_DIRECTIVES:  # refused before all of a long line is read
            raise ImporterError(f"over {MAX_DIRECTIVES} #SBATCH options, not read")
        if cursor < len(text) and text[cursor] == "#" and not quote:
            break
    return arguments


def _canonical(name: str) -> str:
    if name in _LONG_VALUED or name in _LONG_FLAGS:
        return name
    matches = [option for option in (*_LONG_VALUED, *_LONG_FLAGS) if option.startswith(name)]
    return matches[0] if len(matches) == 1 else name


def _directives(
    arguments: list[_Argument], line_start: int, group: int, number: int, notes: list[str]
) -> list[RawDirective]:
    result: list[RawDirective] = []
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        index += 1
        text = argument.value
        if text.lower() in {"hetjob", "packjob"}:
            continue
        if text.startswith("--"):
            name, equals, inline = text[2:].partition("=")
            option = _canonical(name)
            written = f"--{name}"
            if equals:
                offset = argument.start + 2 + len(name) + 1
                span = (offset, argument.end) if argument.plain else (-1, -1)
                result.append(RawDirective(option, written, inline, *span, line_start, group))
                continue
            takes_value = option in _LONG_VALUED or option not in _LONG_FLAGS
        elif text.startswith("-") and len(text) >= 2:
            letter = text[1]
            option = _SHORT.get(letter, letter)
            written = f"-{letter}"
            if len(text) > 2:
                inline = text[2:].removeprefix("=")
                offset = argument.end - len(inline)
                span = (offset, argument.end) if argument.plain else (-1, -1)
                result.append(RawDirective(option, written, inline, *span, line_start, group))
                continue
            takes_value = letter not in _SHORT_FLAGS
        else:
            notes.append(f"line {number}: #SBATCH argument {text!r} is not an option")
            continue
        following = arguments[index] if index < len(arguments) else None
        if (
            takes_value
            and following is not None
            and not (
                option in _LONG_FLAGS
                or (following.value.startswith("-") and option not in _LONG_VALUED)
            )
        ):
            index += 1
            span = (following.start, following.end) if following.plain else (-1, -1)
            result.append(RawDirective(option, written, following.value, *span, line_start, group))
        else:
            result.append(RawDirective(option, written, "", -1, -1, line_start, group))
    for directive in result:
        if _PLACEHOLDER.search(directive.value):
            notes.append(
                f"line {number}: #SBATCH {directive.written} {directive.value!r} is a placeholder"
            )
    return result


_TYPED_COUNT = re.compile(r"(?:[^:,]+:)?(?P<count>\d+)\Z")


def gpu_count(option: str, value: str) -> tuple[int, int] | None:
    """(offset, end) of the per-node GPU count inside a GPU directive's value, when it has
    one: `gpu:a100:4,nvme:10` -> the `4`; `a100:8` for --gpus-per-node -> the `8`."""
    if option == "gres":
        offset = 0
        for entry in value.split(","):
            fields = entry.split("(")[0].split(":")
            if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
                start = offset + len(entry.split("(")[0]) - len(fields[-1])
                return start, start + len(fields[-1])
            offset += len(entry) + 1
        return None
    if option in {"gpus-per-node", "gpus-per-task", "gpus"}:
        match = _TYPED_COUNT.match(value)
        if match:
            return match.start("count"), match.end("count")
    return None
