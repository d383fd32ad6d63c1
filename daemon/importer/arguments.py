"""A command's words as a launcher and a program read them: which launcher starts the run
(`python -m torch.distributed.run`, srun's heterogeneous group), and the program's own flags,
`key=value` overrides and positional arguments, each with the text it came from.

Pure and stateless: the walk (`analysis`) decides what each argument means for a knob.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from daemon.importer.expansion import WORKDIR
from daemon.importer.values import Text, whole_number
from daemon.importer.vocabulary import LAUNCHERS, NAMES, LauncherKind, launcher_kind, normalise

OVERRIDE = re.compile(r"(?P<key>[+~]{0,2}[A-Za-z_][\w.-]*(?:\[\d+\])?)=")  # `key=value`
# The owner's name and home: unknown to the analysis, known to the caller that reads files.
_OWNER = frozenset({"$USER", "${USER}", "$HOME", "${HOME}", "$LOGNAME", "${LOGNAME}"})


@dataclass(frozen=True)
class Argument:
    """One argument of a program as written: a flag, an override, a positional word."""

    field: Text
    path: tuple[str, ...]  # key path of a flag or an override
    display: str  # the flag or key as written
    value: Text | None  # None: a flag's presence
    flag: bool = False
    positional: bool = False
    opaque: bool = False  # a field that may expand to any arguments at run time


def parse_arguments(arguments: list[Text]) -> list[Argument]:
    """A program's arguments as flags (`--name value`, `--name=value`), overrides
    (`a.b=1`, a short flag's `-o a=1`) and positional words; a word only known at run time is
    opaque."""
    parsed: list[Argument] = []
    index = 0
    while index < len(arguments):
        current = arguments[index]
        word = current.plain
        index += 1
        first = current.segs[0] if current.segs else None
        # A word that starts with the working directory or the owner's home is one path.
        if first is not None and first.opaque and first.why != WORKDIR and first.text not in _OWNER:
            parsed.append(Argument(current, (), word, None, opaque=True))
            continue
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            stripped = word.lstrip("-")
            name, equals, _ = stripped.partition("=")
            dashes = len(word) - len(stripped)
            value: Text | None = None
            if equals:
                value = current.slice(dashes + len(name) + 1, len(word))
            elif (
                index < len(arguments)
                and (
                    not arguments[index].plain.startswith("-") or _is_number(arguments[index].plain)
                )
                and lookup_presence(name) is False
            ):
                value = arguments[index]
                index += 1
            display = word[: dashes + len(name)]
            if value is not None and len(name) <= 2 and (inner := OVERRIDE.match(value.plain)):
                key = inner.group("key").lstrip("+~")
                parsed.append(
                    Argument(
                        current,
                        tuple(key.split(".")),
                        key,
                        value.slice(inner.end(), len(value)),
                        flag=False,
                    )
                )
                continue
            parsed.append(Argument(current, tuple(name.split(".")), display, value, flag=True))
            continue
        override = OVERRIDE.match(word)
        if override:
            key = override.group("key").lstrip("+~")
            path = tuple(re.sub(r"\[\d+\]\Z", "", key).split("."))
            parsed.append(Argument(current, path, key, current.slice(override.end(), len(word))))
            continue
        parsed.append(Argument(current, (), word, current, positional=True))
    return parsed


def lookup_presence(name: str) -> bool:
    """Whether a flag never takes a value (`--checkpoint-activations`)."""
    known = NAMES.get(normalise(name))
    return known is not None and known.presence


def _is_number(word: str) -> bool:
    return bool(re.fullmatch(r"-?[0-9][0-9._e+-]*", word))


def override_list(value: Text) -> list[tuple[str, Text]]:
    """`a=1,b=2` -> [(a, 1), (b, 2)], with each value's provenance."""
    result = []
    position = 0
    for chunk in value.plain.split(","):
        key, equals, _ = chunk.partition("=")
        if equals and key.strip():
            start = position + len(key) + 1
            result.append((key.strip(), value.slice(start, position + len(chunk))))
        position += len(chunk) + 1
    return result


def launcher_of(base: str, fields: list[Text]) -> tuple[LauncherKind | None, int]:
    """The launcher a command starts with, and the index of the first field after its name."""
    found = launcher_kind(base, fields[1].plain if len(fields) > 1 else "")
    return found if found is not None else (None, 0)


_MODULE_LAUNCHERS = {
    "torch.distributed.run": LauncherKind.TORCHRUN,
    "torch.distributed.launch": LauncherKind.TORCHRUN,
    "accelerate.commands.launch": LauncherKind.ACCELERATE,
    "deepspeed.launcher.runner": LauncherKind.DEEPSPEED,
    "composer.cli.launcher": LauncherKind.COMPOSER,
}


def python_program(fields: list[Text], index: int) -> tuple[LauncherKind | None, int, str | None]:
    """After `python`: its own options, then `-m module` or the script. Returns the launcher
    the module is (torch.distributed.run...) with the index after it, or PYTHON with the
    script's index, and the module name when the program is a module."""
    options = LAUNCHERS[LauncherKind.PYTHON]
    while index < len(fields):
        word = fields[index].plain
        if word == "-m" and index + 1 < len(fields):
            module = fields[index + 1].plain
            launcher = _MODULE_LAUNCHERS.get(module)
            if launcher is not None:
                return launcher, index + 2, None
            return LauncherKind.PYTHON, index + 2, module
        if word == "-c":
            return None, index, None
        if not word.startswith("-"):
            return LauncherKind.PYTHON, index, None
        letters = word.lstrip("-").lower()
        index += 2 if letters in options.valued else 1
    return None, index, None


def het_group(before: tuple[Text, ...]) -> int:
    """The heterogeneous job component srun's options before the command name (0: the first)."""
    for index, text in enumerate(before):
        word = text.plain
        for prefix in ("--het-group", "--pack-group"):
            if word.startswith(prefix + "="):
                number = word.split("=", 1)[1].split(",")[0]
                return (whole_number(number) or 0) if number.isdigit() else 0
            if word == prefix and index + 1 < len(before):
                number = before[index + 1].plain.split(",")[0]
                return (whole_number(number) or 0) if number.isdigit() else 0
    return 0


def owner_relative(path: Text) -> bool:
    """A path whose only unknown parts are the owner's name or home directory."""
    unknowns = path.unknowns()
    if unknowns:
        return all(seg.text in _OWNER for seg in unknowns)
    return path.plain.startswith("~/")
