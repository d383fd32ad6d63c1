"""The files behind `slurm-medic template analyse`: the script and what its analysis asks for.

`gather` runs the importer's loop with the caller's reader: analyse the script, read the files
the analysis asks for (a DeepSpeed or accelerate config beside it, a YAML by path), analyse
again, until nothing new is wanted or the rounds run out; every file keeps its outcome (read,
missing, refused and why), so a knob left "set at run time" by a file that was not there says
which file. Apart from the document (`import_json`) and the text (`import_report`) because it
is the only part that reads files, through the owner's reader.
"""

from __future__ import annotations

import posixpath
import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from daemon.importer import Analysis, ImporterError, Knob, analyse
from daemon.importer.records import MAX_INPUT_CHARS
from daemon.owner_files import Owner, OwnerFiles, OwnerReadRefused, Refusal
from daemon.owner_walk import RefusalKind

MAX_ROUNDS: Final = 6  # analyse, read what it asks for, again; the real corpus needs at most 3
MAX_FILES: Final = 64  # files read besides the script; a real script names a handful
MAX_FILE_BYTES: Final = MAX_INPUT_CHARS  # what the analysis accepts of one file
ReadFile = Callable[[str], bytes]  # an absolute path -> its bytes; raises OwnerReadRefused
_OWNER_NAME = re.compile(r"\$(?:USER|LOGNAME)\b|\$\{(?:USER|LOGNAME)\}")
_OWNER_HOME = re.compile(r"\$HOME\b|\$\{HOME\}")


class FileState(StrEnum):
    READ = "read"
    MISSING = "missing"
    REFUSED = "refused"  # there, but not read: not a regular file, a link, no rights, too big
    SKIPPED = "skipped"  # not tried: over the file or round limit, or its path is not known


@dataclass(frozen=True)
class FileOutcome:
    """One file the script names, and what became of it."""

    path: str  # as the script names it
    location: str | None  # where it was looked for; None when the path could not be placed
    state: FileState
    refusal: RefusalKind | None
    reason: str


@dataclass(frozen=True)
class Gathered:
    """The last analysis of a script and the files read for it."""

    script: str
    submit_dir: str
    analysis: Analysis
    files: tuple[FileOutcome, ...]
    rounds: int
    texts: Mapping[str, str] = field(default_factory=dict)  # path the script names -> text read


class ScriptUnreadable(Exception):
    """The script itself could not be read or analysed: nothing to report on."""


def caller_reader(owner: Owner | None = None) -> ReadFile:
    """Reads with the caller's rights (or `owner`'s) through the bounded reader: one file in
    its own directory's tree, regular files only, at most one byte over the cap."""
    files = OwnerFiles.as_caller() if owner is None else OwnerFiles(owner)

    def read(location: str) -> bytes:
        return files.read_tail(location, MAX_FILE_BYTES + 1, tree=posixpath.dirname(location))

    return read


def read_text(read: ReadFile, location: str) -> str:
    """A file's text as the analysis takes it (bytes that are not UTF-8 kept as surrogates);
    a file over the cap or with NUL bytes is refused like one the reader would not open."""
    data = read(location)
    if len(data) > MAX_FILE_BYTES:
        raise _refused(RefusalKind.TOO_LARGE, location, f"over {MAX_FILE_BYTES} bytes")
    if b"\0" in data:
        raise _refused(RefusalKind.UNUSABLE, location, "NUL bytes: not a text file")
    return data.decode("utf-8", "surrogateescape")


def read_script(read: ReadFile, location: str) -> str:
    try:
        return read_text(read, location)
    except OwnerReadRefused as error:
        refusal = error.refusal
        raise ScriptUnreadable(
            f"cannot read {location}: {refusal.kind}: {refusal.reason}"
        ) from None


def gather(
    script: str,
    *,
    name: str,
    read: ReadFile,
    submit_dir: str,
    owner: Owner,
    knob_names: Mapping[str, Knob] | None = None,
) -> Gathered:
    """Analyse `script`, read what it asks for, again, until nothing new is wanted."""
    try:
        analysis = analyse(script, name=name, knob_names=knob_names)
    except ImporterError as error:
        raise ScriptUnreadable(str(error)) from error
    texts: dict[str, str] = {}
    outcomes: dict[str, FileOutcome] = {}
    rounds = 1
    while True:
        wanted = [path for path in analysis.files_wanted if path not in outcomes]
        if not wanted:
            break
        if rounds >= MAX_ROUNDS:
            for path in wanted:
                outcomes[path] = FileOutcome(
                    path,
                    locate(path, submit_dir, owner),
                    FileState.SKIPPED,
                    None,
                    f"not read: stopped after {rounds} rounds",
                )
            break
        fresh: dict[str, str] = {}
        for path in wanted:
            outcome, text = _fetch(path, read, submit_dir, owner, tried=len(outcomes))
            outcomes[path] = outcome
            if text is not None:
                fresh[path] = text
        if not fresh:
            break
        try:
            analysis = analyse(script, name=name, files={**texts, **fresh}, knob_names=knob_names)
        except ImporterError as error:
            for path in fresh:
                outcomes[path] = _unusable(outcomes[path], f"not analysed: {error}")
            break
        texts.update(fresh)
        rounds += 1
    return Gathered(name, submit_dir, analysis, tuple(outcomes.values()), rounds, texts)


def locate(path: str, submit_dir: str, owner: Owner) -> str | None:
    """Where a path the script names lies for its owner: `~`, `$USER` and `$HOME` are the
    owner's, a relative path is relative to the submit directory."""
    if path.startswith("~/") or _OWNER_HOME.search(path):
        home = _home(owner)
        if home is None:
            return None
        expanded = home + path[1:] if path.startswith("~/") else path
        path = _OWNER_HOME.sub(lambda _: home, expanded)
    path = _OWNER_NAME.sub(lambda _: owner.name, path)
    return posixpath.normpath(posixpath.join(submit_dir, path))


def _fetch(
    path: str, read: ReadFile, submit_dir: str, owner: Owner, *, tried: int
) -> tuple[FileOutcome, str | None]:
    """One file the analysis asks for; `tried` files were asked for before it."""
    location = locate(path, submit_dir, owner)
    if location is None:
        reason = f"not read: the home directory of {owner.name} is not known"
        return FileOutcome(path, None, FileState.SKIPPED, None, reason), None
    if tried >= MAX_FILES:
        reason = f"not read: the script names more than {MAX_FILES} files"
        return FileOutcome(path, location, FileState.SKIPPED, None, reason), None
    try:
        text = read_text(read, location)
    except OwnerReadRefused as error:
        refusal = error.refusal
        state = FileState.MISSING if refusal.kind is RefusalKind.MISSING else FileState.REFUSED
        return FileOutcome(path, location, state, refusal.kind, refusal.reason), None
    return FileOutcome(path, location, FileState.READ, None, "read"), text


def _unusable(outcome: FileOutcome, reason: str) -> FileOutcome:
    return FileOutcome(
        outcome.path, outcome.location, FileState.REFUSED, RefusalKind.UNUSABLE, reason
    )


def _home(owner: Owner) -> str | None:
    try:
        return pwd.getpwuid(owner.uid).pw_dir or None
    except KeyError:
        return None


def _refused(kind: RefusalKind, location: str, reason: str) -> OwnerReadRefused:
    return OwnerReadRefused(Refusal(kind, location, Owner.current().name, reason))
