"""Find the last good checkpoint of a run, for each framework's layout.

A checkpoint counts only when it is complete: a job that died while saving leaves a directory
that looks right and is not. Each candidate that is skipped carries the reason. Nothing outside
the checkpoint root is read: a symlink that leaves it is refused, and a symlink loop is a reason,
not a hang.

Reading happens through `CheckpointReader`, a small seam over the file system. The daemon runs as
root and must read with the job owner's rights: `daemon.owner_files` calls `find_last_good`
inside a child that has dropped to the owner's uid/gid, with a reader that walks the checkpoint
root one component at a time (`openat`, no link followed outside the root, files size-capped
before reading), so a path the owner cannot read is refused by the kernel, not by us.
`LocalReader` is the plain implementation (the caller's rights, the kernel's path lookup) for
trees the caller trusts.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Protocol

_SMALL_FILE = 4096
_JSON_LIMIT = 64 * 1024 * 1024
# Objects and arrays in one JSON file (counted as `{` and `[` bytes, strings included): a real
# trainer_state.json or shard index holds thousands; millions of empty ones in 64 MiB would
# take over a GiB to build, more than the owner's reading child may use.
_JSON_CONTAINERS = 2_000_000
# The record keeps steps as 64-bit integers; a directory or file naming a larger step is hostile.
MAX_STEP = 2**63 - 1
_STEP_DIGITS = re.compile(r"[0-9]{1,19}\Z")
# ASCII digits only, anchored with \Z: a name with a newline or a look-alike digit is no checkpoint.
_TRAILING_NUMBER = re.compile(r"([0-9]+)\Z")
_HF_DIR = re.compile(r"checkpoint-([0-9]+)")
_MEGATRON_DIR = re.compile(r"iter_([0-9]+)")
_DEEPSPEED_DIR = re.compile(r"global_step([0-9]+)")
# The weight files transformers' Trainer accepts when it resumes (Trainer._load_from_checkpoint).
_HF_SINGLE_WEIGHTS = (
    "model.safetensors",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
_HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class CheckpointLayout(StrEnum):
    HF = "hf"  # OUTPUT_DIR/checkpoint-N/{trainer_state.json, weights}
    MEGATRON = "megatron"  # ROOT/latest_checkpointed_iteration.txt + ROOT/iter_NNNNNNN/
    DEEPSPEED = "deepspeed"  # ROOT/latest (a tag) + ROOT/<tag>/
    DCP = "dcp"  # ROOT/<step dir>/.metadata (torch.distributed.checkpoint)
    GLOB = "glob"  # ROOT/<glob match>/<marker>


@dataclass(frozen=True)
class CheckpointSpec:
    """Where a template's run writes checkpoints, and how they are laid out."""

    layout: CheckpointLayout
    root: str
    glob: str = ""
    marker: str = ""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint and how to resume from it (`resume_path`, `tag` for DeepSpeed)."""

    layout: CheckpointLayout
    path: Path
    step: int | None
    resume_path: str
    tag: str | None = None


@dataclass(frozen=True)
class Skipped:
    """A candidate that was not used, and why (names shown with repr: they may hold newlines)."""

    name: str
    reason: str


@dataclass(frozen=True)
class CheckpointScan:
    """The result of a search: the last good checkpoint (or None, with `reason`) and the skips."""

    root: str
    found: Checkpoint | None
    skipped: tuple[Skipped, ...]
    reason: str = ""


class CheckpointError(Exception):
    """The checkpoint root itself cannot be used (missing, not a directory, unreadable)."""


class CheckpointReader(Protocol):
    """The file-system seam: every read of the search goes through these four calls."""

    def list_dir(self, path: Path) -> list[str]: ...

    def kind(self, path: Path) -> str:
        """'dir', 'file', 'other', or 'missing', following symlinks."""
        ...

    def resolve(self, path: Path) -> Path:
        """The real path; raises OSError or RuntimeError on a loop or a dangling link."""
        ...

    def read_bytes(self, path: Path, limit: int) -> bytes: ...


class LocalReader:
    """Reads with the rights of the calling process."""

    def list_dir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def kind(self, path: Path) -> str:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return "missing"
        except OSError:
            return "other"  # a loop, or a path the reader may not look at
        if stat.S_ISDIR(mode):
            return "dir"
        return "file" if stat.S_ISREG(mode) else "other"

    def resolve(self, path: Path) -> Path:
        return path.resolve(strict=True)

    def read_bytes(self, path: Path, limit: int) -> bytes:
        """Non-blocking, regular files only, refused from the size before any read."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(f"{path.name} is not a regular file")
            if status.st_size > limit:
                raise OSError(f"larger than {limit} bytes")
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise OSError(f"larger than {limit} bytes")
        return data


class _Refused(Exception):
    """A candidate that must be skipped; the message is the reason."""


class _Search:
    def __init__(self, root: Path, reader: CheckpointReader) -> None:
        self.reader = reader
        self.root = root
        try:
            self.real_root = reader.resolve(root)
        except (OSError, RuntimeError) as error:
            raise CheckpointError(
                f"checkpoint root {str(root)!r} cannot be used: {error}"
            ) from error
        if reader.kind(self.real_root) != "dir":
            raise CheckpointError(f"checkpoint root {str(root)!r} is not a directory")

    def inside(self, path: Path) -> Path:
        """The real path of `path`, refused if it is a loop or leaves the root."""
        try:
            real = self.reader.resolve(path)
        except RuntimeError as error:
            raise _Refused(f"symlink loop: {error}") from error
        except FileNotFoundError:
            raise _Refused(f"{path.name!r} is missing or a dangling symlink") from None
        except OSError as error:
            reason = "symlink loop" if error.errno == 40 else (error.strerror or str(error))
            raise _Refused(f"{path.name!r}: {reason}") from error
        if real != self.real_root and self.real_root not in real.parents:
            raise _Refused(f"{path.name!r} is a symlink leaving the checkpoint root (to {real})")
        return real

    def names(self, directory: Path) -> list[str]:
        try:
            return self.reader.list_dir(directory)
        except OSError as error:
            raise _Refused(f"cannot list {directory.name!r}: {error.strerror}") from error

    def is_file(self, path: Path) -> bool:
        try:
            real = self.inside(path)
        except _Refused:
            return False
        return self.reader.kind(real) == "file"

    def read(self, path: Path, limit: int) -> bytes:
        real = self.inside(path)
        if self.reader.kind(real) != "file":
            raise _Refused(f"{path.name} is missing")
        try:
            return self.reader.read_bytes(real, limit)
        except OSError as error:
            raise _Refused(f"cannot read {path.name}: {error.strerror or error}") from error

    def read_json(self, path: Path) -> object:
        """The parsed file, or `_Refused` for anything a hostile or broken file can make the
        parser do: fail, recurse past the interpreter's limit (100,000 nested `[`), run out of
        memory, or meet a number too long to convert."""
        data = self.read(path, _JSON_LIMIT)
        if data.count(b"{") + data.count(b"[") > _JSON_CONTAINERS:
            raise _Refused(f"{path.name} holds over {_JSON_CONTAINERS} objects and arrays")
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise _Refused(
                f"{path.name} is not valid JSON (cut off while saving?): {error}"
            ) from error
        except RecursionError:
            raise _Refused(f"{path.name} nests too deeply to be read") from None
        except MemoryError:
            raise _Refused(f"{path.name} is too large to be read") from None
        except ValueError:  # an integer of more digits than int() converts
            raise _Refused(f"{path.name} holds a number too long to be read") from None

    def read_line(self, path: Path) -> str:
        try:
            return self.read(path, _SMALL_FILE).decode("utf-8").strip()
        except UnicodeDecodeError as error:
            raise _Refused(f"{path.name} is not text") from error

    def numbered_dirs(self, pattern: re.Pattern[str] | None) -> list[tuple[int, str]]:
        """Subdirectories matching `pattern` (any name ending in digits if None), newest first."""
        found: list[tuple[int, str]] = []
        for name in self.names(self.real_root):
            match = pattern.fullmatch(name) if pattern else _TRAILING_NUMBER.search(name)
            if match:
                found.append((int(match.group(1)), name))
        return sorted(found, reverse=True)


def find_last_good(spec: CheckpointSpec, reader: CheckpointReader | None = None) -> CheckpointScan:
    """The newest complete checkpoint under `spec.root`, with a reason for every skipped one.

    A root that does not exist yet (the job died before its first save) is no checkpoint, not
    an error; `CheckpointError` is raised only when the root exists and cannot be used.
    """
    reader = reader or LocalReader()
    if reader.kind(Path(spec.root)) == "missing" and not Path(spec.root).is_symlink():
        return CheckpointScan(spec.root, None, (), "the checkpoint root does not exist yet")
    search = _Search(Path(spec.root), reader)
    finder = _FINDERS[spec.layout]
    skipped: list[Skipped] = []
    try:
        found = finder(search, spec, skipped)
    except _Refused as error:
        return CheckpointScan(spec.root, None, tuple(skipped), str(error))
    reason = "" if found else "no complete checkpoint under the root"
    return CheckpointScan(spec.root, found, tuple(skipped), reason)


def _first_complete(
    search: _Search,
    candidates: list[tuple[int, str]],
    check: Callable[[Path], None],
    skipped: list[Skipped],
) -> tuple[int, Path] | None:
    for step, name in candidates:
        path = search.real_root / name
        try:
            if step > MAX_STEP:
                raise _Refused(f"step number over {MAX_STEP}: not a real step")
            real = search.inside(path)
            if search.reader.kind(real) != "dir":
                raise _Refused("not a directory")
            check(real)
        except _Refused as error:
            skipped.append(Skipped(repr(name), str(error)))
            continue
        return step, real
    return None


def _hf_check(search: _Search) -> Callable[[Path], None]:
    def check(path: Path) -> None:
        state = search.read_json(path / "trainer_state.json")
        if not isinstance(state, dict):
            raise _Refused("trainer_state.json is not an object")
        problem = _trainer_state_problem(state)
        if problem:
            raise _Refused(f"trainer_state.json: {problem}")
        if any(search.is_file(path / name) for name in _HF_SINGLE_WEIGHTS):
            return
        for index_name in _HF_INDEXES:
            if search.is_file(path / index_name):
                index = search.read_json(path / index_name)
                weight_map = index.get("weight_map") if isinstance(index, dict) else None
                if not isinstance(weight_map, dict) or not weight_map:
                    raise _Refused(f"{index_name} has no weight_map")
                missing = sorted(
                    {str(shard) for shard in weight_map.values()}
                    - {name for name in search.names(path) if search.is_file(path / name)}
                )
                if missing:
                    raise _Refused(f"shards missing from {index_name}: {', '.join(missing[:3])}")
                return
        raise _Refused("no weights (model.safetensors, pytorch_model.bin or a sharded index)")

    return check


def _trainer_state_problem(state: dict[str, object]) -> str | None:
    """What makes the fields the Trainer resumes from unusable (None: nothing): the step it
    skips to, the epoch it resumes in, the log it extends. Values are named by their type, never
    printed: a hostile one may be huge."""
    step = state.get("global_step")
    if "global_step" in state:
        if not isinstance(step, int) or isinstance(step, bool):
            return f"global_step is {_kind(step)}, not an integer"
        if not 0 <= step <= MAX_STEP:
            return f"global_step is out of range (0 to {MAX_STEP})"
    epoch = state.get("epoch")
    if epoch is not None:
        if not isinstance(epoch, int | float) or isinstance(epoch, bool):
            return f"epoch is {_kind(epoch)}, not a number"
        if not (math.isfinite(epoch) and 0 <= epoch <= MAX_STEP):
            return "epoch is out of range (a finite number from 0)"
    if "log_history" in state and not isinstance(state["log_history"], list):
        return f"log_history is {_kind(state['log_history'])}, not a list"
    return None


def _kind(value: object) -> str:
    """A JSON value's kind in words."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    names |= {int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _find_hf(search: _Search, _spec: CheckpointSpec, skipped: list[Skipped]) -> Checkpoint | None:
    result = _first_complete(search, search.numbered_dirs(_HF_DIR), _hf_check(search), skipped)
    if result is None:
        return None
    step, path = result
    return Checkpoint(CheckpointLayout.HF, path, step, str(path))


def _non_empty(search: _Search, what: str) -> Callable[[Path], None]:
    def check(path: Path) -> None:
        if not search.names(path):
            raise _Refused(f"{what} directory is empty")

    return check


def _find_megatron(
    search: _Search, _spec: CheckpointSpec, skipped: list[Skipped]
) -> Checkpoint | None:
    tracker = search.read_line(search.real_root / "latest_checkpointed_iteration.txt")
    candidates = search.numbered_dirs(_MEGATRON_DIR)
    if tracker == "release":
        return Checkpoint(
            CheckpointLayout.MEGATRON, search.real_root / "release", None, str(search.real_root)
        )
    # ASCII digits only: str.isdigit() takes '²', which int() refuses.
    if not _STEP_DIGITS.match(tracker) or int(tracker) > MAX_STEP:
        raise _Refused(
            f"latest_checkpointed_iteration.txt holds {tracker[:40]!r}, not an iteration"
        )
    latest = int(tracker)
    for step, name in candidates:
        if step > latest:
            skipped.append(
                Skipped(repr(name), f"newer than the tracker's {latest}: save did not finish")
            )
    wanted = [(step, name) for step, name in candidates if step == latest]
    if not wanted:
        raise _Refused(f"the tracker names iteration {latest} but iter_{latest:07d} is missing")
    result = _first_complete(search, wanted, _non_empty(search, "iteration"), skipped)
    if result is None:
        return None
    return Checkpoint(CheckpointLayout.MEGATRON, result[1], latest, str(search.real_root))


def _find_deepspeed(
    search: _Search, _spec: CheckpointSpec, skipped: list[Skipped]
) -> Checkpoint | None:
    tag = search.read_line(search.real_root / "latest")
    if not tag or "/" in tag or tag in {".", ".."}:
        raise _Refused(f"the `latest` file holds {tag[:40]!r}, not a tag")
    number = _TRAILING_NUMBER.search(tag)
    step = int(number.group(1)) if number else None
    if step is not None:
        for other_step, name in search.numbered_dirs(_DEEPSPEED_DIR):
            if other_step > step:
                skipped.append(
                    Skipped(repr(name), f"newer than `latest` ({tag}): save did not finish")
                )
    result = _first_complete(search, [(step or 0, tag)], _non_empty(search, "tag"), skipped)
    if result is None:
        return None
    return Checkpoint(CheckpointLayout.DEEPSPEED, result[1], step, str(search.real_root), tag)


def _marker_check(search: _Search, marker: str) -> Callable[[Path], None]:
    def check(path: Path) -> None:
        if not search.is_file(path / marker):
            raise _Refused(f"no {marker} marker: the save did not finish")

    return check


def _dcp_check(search: _Search) -> Callable[[Path], None]:
    """`.metadata` is renamed into place by the coordinator after every rank's data is written.

    A save with `use_collectives=False` writes only per-rank `__R.metadata` files: `dcp.load`
    reads them, but nothing on disk says how many ranks there were, so a rank that died before
    writing a byte is invisible and the save cannot be called complete.
    """
    marker = _marker_check(search, ".metadata")

    def check(path: Path) -> None:
        if not search.is_file(path / ".metadata") and search.is_file(path / "__0.metadata"):
            raise _Refused(
                "only per-rank __R.metadata files (saved with use_collectives=False): "
                "the number of ranks is not on disk, so completeness cannot be checked"
            )
        marker(path)

    return check


def _find_dcp(search: _Search, _spec: CheckpointSpec, skipped: list[Skipped]) -> Checkpoint | None:
    result = _first_complete(search, search.numbered_dirs(None), _dcp_check(search), skipped)
    if result is None:
        return None
    return Checkpoint(CheckpointLayout.DCP, result[1], result[0], str(result[1]))


def _find_glob(search: _Search, spec: CheckpointSpec, skipped: list[Skipped]) -> Checkpoint | None:
    if not spec.glob or "/" in spec.glob or not spec.marker or "/" in spec.marker:
        raise _Refused("a glob layout needs a one-level `glob` and a `marker` file name")
    candidates = [
        (step, name) for step, name in search.numbered_dirs(None) if fnmatchcase(name, spec.glob)
    ]
    result = _first_complete(search, candidates, _marker_check(search, spec.marker), skipped)
    if result is None:
        return None
    return Checkpoint(CheckpointLayout.GLOB, result[1], result[0], str(result[1]))


_FINDERS: dict[
    CheckpointLayout, Callable[[_Search, CheckpointSpec, list[Skipped]], Checkpoint | None]
] = {
    CheckpointLayout.HF: _find_hf,
    CheckpointLayout.MEGATRON: _find_megatron,
    CheckpointLayout.DEEPSPEED: _find_deepspeed,
    CheckpointLayout.DCP: _find_dcp,
    CheckpointLayout.GLOB: _find_glob,
}
