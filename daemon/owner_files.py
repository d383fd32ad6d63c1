"""Read what a user wrote (logs, checkpoints, receipts, templates) as that user, never as root.

The daemon runs as root so that it can submit as owners and drain nodes; root may read every
file, and a job's output directory or a template directory is the owner's to fill with
anything, a symlink to `/etc/shadow` or `/dev/zero` or a FIFO included. So every such read
happens in a short-lived child that has become the owner (`setpriv --reuid --regid
--init-groups`, through the one subprocess seam) before it opens anything: the kernel, not our
checks, says what the owner may read. The child limits itself before it reads a byte (1 GiB of
address space, CPU a little over the timeout, no file writes, few descriptors, no core), so a
hostile file can only break the child: the caller gets a refusal of kind `failed` or `timeout`.
The child answers one JSON request with one JSON line. A job log is scanned in the child too,
as `slurm-medic diagnose --log` scans it: the child opens the log through the walk and runs the
job-log scanner on its descriptor, from the end back as far as the scan needs (the root failure
behind a cascade of thousands of ranks) and at most `max_bytes`, within the scanner's time limit.
The scanner reads with `pread` in windows of a few MiB and keeps only what its analysis needs,
so the 1 GiB address-space limit holds whatever the log's size (a memory map of a huge log
would count against it, and a log cut short under it would kill the child with SIGBUS). The
daemon never holds more than the findings.

Not running as root, the same walk runs in this process with its own rights.

The walk, and the owner's tree. Each read names a tree (a directory: a template's own
directory, the job's work dir for a log that lies in it and else the log's own directory, a
checkpoint root) and a path inside it. Paths are opened one component at a time with
`openat(..., O_PATH | O_NOFOLLOW)` from the directory above, never by a path the kernel
resolves, so a component swapped for a link halfway is seen, not followed:
- Down to the tree itself, a symlink is followed only if root owns it (the system's own layout,
  `/home -> /data/home`), or the owner does and the read is the owner's (then the rights are the
  owner's anyway).
- Inside the tree, a symlink is followed only when the read is the owner's, and only while it
  stays inside: `..` may not climb above the tree, and an absolute target must name the tree.
  Any other link, in the middle of the path or at its end, is refused.
- Only regular files are read (opened non-blocking, so a FIFO cannot hang the open), and a file
  over its cap is refused from its size before any read; at most cap + 1 bytes are ever read.

Whatever the cause (no permission, a link that leaves the tree, a FIFO, a directory, a size
over the cap, a timeout, an owner without a uid), the caller gets `OwnerReadRefused` with a
typed `Refusal` to put on the record, never the content.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import math
import os
import pwd
import re
import resource
import stat
import sys
import tomllib
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from daemon.checkpoints import (
    Checkpoint,
    CheckpointError,
    CheckpointLayout,
    CheckpointScan,
    CheckpointSpec,
    Skipped,
    find_last_good,
)
from daemon.evidence.joblog import DEFAULT_BYTE_BUDGET, LogReadError, scan_log
from daemon.evidence.records import LogFindings
from daemon.process import CommandError, CommandTimeout, run
from daemon.store.codec import CodecError, from_json, to_json

DEFAULT_TIMEOUT_S = 60.0
MAX_TAIL_BYTES = 16 * 1024 * 1024  # what `read_tail` hands over, base64 in one JSON line
# How far back a log scan may be asked to look: the scan's time limit bounds its work whatever
# this is, and it reads in windows, never the whole span at once.
MAX_SCAN_BYTES = 1024**4
TEMPLATE_FILE = "template.toml"
MAX_TEMPLATE_FILE_BYTES = 1_000_000  # template.toml and its script: real ones are a few KB
# Config files an imported template keeps (`[configs]`: a DeepSpeed JSON, a YAML), each under
# the file cap, all of them under the total: the answer carries them as JSON text.
MAX_TEMPLATE_CONFIGS = 8
MAX_TEMPLATE_CONFIG_BYTES = 2_000_000
MAX_SYMLINKS = 40  # the kernel's own limit on links in one lookup
MAX_DEPTH = 64  # directories held open by one walk (each is a descriptor)
CHILD_MEMORY_BYTES = 1024**3
CHILD_OPEN_FILES = 256
_CHILD_MODULE = "daemon.owner_files"
# The largest honest answer is a read_tail's MAX_TAIL_BYTES in base64 (4/3) inside JSON; the
# child runs as the owner, who could make it print anything, so more than that is refused.
_MAX_ANSWER_BYTES = 2 * MAX_TAIL_BYTES
_CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
_MAX_REQUEST_CHARS = 1024 * 1024
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RefusalKind(StrEnum):
    DENIED = "denied"  # the owner may not read it
    NOT_REGULAR = "not_regular"  # a FIFO, a device, a directory, a socket
    MISSING = "missing"
    SYMLINK = "symlink"  # a link not followed: not the owner's read, or it leaves the tree
    OUTSIDE = "outside"  # the path itself names something outside the tree it is read in
    TOO_LARGE = "too_large"  # over the size cap, refused before reading
    UNUSABLE = (
        "unusable"  # exists, but not as the operation needs (a checkpoint root that is a file)
    )
    NO_OWNER = "no_owner"  # the job's owner has no known uid here
    TIMEOUT = "timeout"
    FAILED = "failed"  # the reading child itself broke (or hit its memory limit)


@dataclass(frozen=True)
class Refusal:
    """Why a user's file was not read, in words for the record."""

    kind: RefusalKind
    path: str
    owner: str
    reason: str


class OwnerReadRefused(Exception):
    """A read as the owner that gave no content; `refusal` belongs on the record."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(
            f"{refusal.path!r} not read as {refusal.owner}: {refusal.kind}: {refusal.reason}"
        )
        self.refusal = refusal


@dataclass(frozen=True)
class Owner:
    """Whose rights a read uses: the uid and primary gid, and the name for messages."""

    name: str
    uid: int
    gid: int

    @classmethod
    def from_uid(cls, uid: int) -> Owner:
        """The owner as the password database knows it; `--init-groups` needs the entry."""
        try:
            entry = pwd.getpwuid(uid)
        except KeyError as error:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", str(uid), f"uid {uid} has no passwd entry")
            ) from error
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid)

    @classmethod
    def from_name(cls, name: str) -> Owner:
        """A lineage's owner, recorded by name."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError as error:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", name, f"user {name!r} has no passwd entry")
            ) from error
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid)

    @classmethod
    def for_job(cls, *, user: str, uid: int | None) -> Owner:
        """The owner of a job record; without a uid nothing is read (never as root instead)."""
        if uid is None:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", user, "the job record has no uid")
            )
        return cls.from_uid(uid)

    @classmethod
    def current(cls) -> Owner:
        """This process's own identity: a CLI reads the caller's files as the caller."""
        uid = os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return cls(name=name, uid=uid, gid=os.getegid())


@dataclass(frozen=True)
class TemplateTexts:
    """A template directory as its owner could read it: `template.toml`, its script, and the
    config files an imported template keeps (file in the directory -> text)."""

    directory: str
    toml_text: str
    script_text: str
    configs: tuple[tuple[str, str], ...] = ()


def job_tree(path: str, work_dir: str | None) -> str:
    """The tree a job's file is read in: the job's work dir when the path lies in it, else the
    file's own directory (a log written elsewhere with `--output`)."""
    if work_dir and _under(_components(path), _components(work_dir)) is not None:
        return work_dir
    return os.path.dirname(path) or "/"


class OwnerFiles:
    """Reads one owner's files: as that owner in a child when root, else in this process."""

    def __init__(
        self,
        owner: Owner,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        drop_privileges: bool | None = None,
    ) -> None:
        self.owner = owner
        self.timeout_s = timeout_s
        if drop_privileges is None:
            drop_privileges = os.geteuid() == 0 and owner.uid != 0
        self.drop_privileges = drop_privileges

    @classmethod
    def as_caller(cls) -> OwnerFiles:
        """The calling process reading its own files, with the same walk and caps."""
        return cls(Owner.current(), drop_privileges=False)

    def scan_log(
        self,
        path: str,
        *,
        max_bytes: int = DEFAULT_BYTE_BUDGET,
        step_pattern: str | None = None,
        tree: str | None = None,
    ) -> LogFindings:
        """The job-log scanner's findings, scanned by the reader from the log's end back at most
        `max_bytes` (the scanner's byte budget): the CLI's scan, with the owner's rights."""
        if not 0 < max_bytes <= MAX_SCAN_BYTES:
            raise ValueError(f"max_bytes must be in 1..{MAX_SCAN_BYTES}, got {max_bytes}")
        request = {
            "op": "scan_log",
            "path": path,
            "tree": tree or job_tree(path, None),
            "max_bytes": max_bytes,
            "step_pattern": step_pattern,
        }
        answer = self._ask(request)
        try:
            return from_json(LogFindings, answer)
        except CodecError as error:
            raise self._failed(path, f"unreadable findings from the reader: {error}") from error

    def read_tail(self, path: str, limit: int, *, tree: str | None = None) -> bytes:
        """The last `limit` bytes of a regular file (at most `MAX_TAIL_BYTES`)."""
        request = {
            "op": "read_tail",
            "path": path,
            "tree": tree or job_tree(path, None),
            "limit": _checked_limit(limit),
        }
        answer = self._ask(request)
        if not isinstance(answer, str):
            raise self._failed(path, "the reader did not return bytes")
        return base64.b64decode(answer)

    def find_last_good(self, spec: CheckpointSpec) -> CheckpointScan:
        """`checkpoints.find_last_good` run whole as the owner (one child, not one per file),
        in the tree of the checkpoint root."""
        request = {
            "op": "find_last_good",
            "path": spec.root,
            "tree": spec.root,
            "layout": spec.layout.value,
            "glob": spec.glob,
            "marker": spec.marker,
        }
        try:
            return _scan_from_json(self._ask(request))
        except (KeyError, TypeError, ValueError) as error:
            raise self._failed(spec.root, f"unreadable scan from the reader: {error}") from error

    def read_template(self, directory: str) -> TemplateTexts:
        """`template.toml`, the script and the config files it names, all read in the
        template's directory."""
        answer = self._ask({"op": "read_template", "path": directory, "tree": directory})
        texts = [answer.get(key) if isinstance(answer, dict) else None for key in _TEXT_KEYS]
        configs = answer.get("configs", {}) if isinstance(answer, dict) else None
        if not all(isinstance(text, str) for text in texts) or not isinstance(configs, dict):
            raise self._failed(directory, "the reader did not return the template's texts")
        if not all(isinstance(text, str) for text in configs.values()):
            raise self._failed(directory, "the reader did not return the configs' texts")
        toml_text, script_text = (str(text) for text in texts)
        kept = tuple((str(name), str(text)) for name, text in configs.items())
        return TemplateTexts(directory, toml_text, script_text, kept)

    def _ask(self, request: dict[str, Any]) -> Any:
        if not self.drop_privileges:
            as_owner = os.geteuid() == self.owner.uid
            return _unwrap(answer(request, as_owner=as_owner), request, self.owner)
        cpu_seconds = math.ceil(self.timeout_s) + 5
        argv = [
            "setpriv",
            "--reuid",
            str(self.owner.uid),
            "--regid",
            str(self.owner.gid),
            "--init-groups",
            "--no-new-privs",
            "--",
            sys.executable,
            "-I",
            "-B",
            "-m",
            _CHILD_MODULE,
            str(cpu_seconds),
        ]
        path = str(request["path"])
        try:
            result = run(
                argv,
                timeout=self.timeout_s,
                input_text=json.dumps(request),
                env=_CHILD_ENV,
                cwd="/",
                max_output_bytes=_MAX_ANSWER_BYTES,
            )
        except CommandTimeout as error:
            raise self._refusal(
                RefusalKind.TIMEOUT, path, f"no answer in {self.timeout_s:g}s"
            ) from error
        except CommandError as error:
            raise self._failed(path, str(error)) from error
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            detail = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
            raise self._failed(path, f"the reading child failed: {detail[0][:500]}")
        try:
            reply = json.loads(lines[-1])
        except json.JSONDecodeError as error:
            raise self._failed(path, f"the reading child's answer is not JSON: {error}") from error
        return _unwrap(reply, request, self.owner)

    def _refusal(self, kind: RefusalKind, path: str, reason: str) -> OwnerReadRefused:
        return OwnerReadRefused(Refusal(kind, path, self.owner.name, reason))

    def _failed(self, path: str, reason: str) -> OwnerReadRefused:
        return self._refusal(RefusalKind.FAILED, path, reason)


_TEXT_KEYS = ("toml", "script")


def _checked_limit(limit: int) -> int:
    if not 0 < limit <= MAX_TAIL_BYTES:
        raise ValueError(f"limit must be in 1..{MAX_TAIL_BYTES}, got {limit}")
    return limit


def _unwrap(reply: object, request: dict[str, Any], owner: Owner) -> Any:
    path = str(request["path"])
    if not isinstance(reply, dict) or not ({"ok"} <= reply.keys() or {"refused"} <= reply.keys()):
        raise OwnerReadRefused(
            Refusal(RefusalKind.FAILED, path, owner.name, "malformed answer from the reader")
        )
    if "ok" in reply:
        return reply["ok"]
    refused = reply["refused"]
    try:
        kind = RefusalKind(refused["kind"])
        reason = str(refused["reason"])
    except (KeyError, TypeError, ValueError):
        kind, reason = RefusalKind.FAILED, "malformed refusal from the reader"
    raise OwnerReadRefused(Refusal(kind, path, owner.name, reason))


# --------------------------------------------------------------------- serving a request


def answer(request: dict[str, Any], *, as_owner: bool) -> dict[str, Any]:
    """Serve one request with this process's rights: `{"ok": ...}` or `{"refused": ...}`.

    `as_owner`: this process has the owner's rights (the child, or the owner's own CLI); only
    then are links followed at all inside the tree (see the module docstring).
    """
    path = str(request["path"])
    tree = str(request.get("tree") or path)
    try:
        if request["op"] == "scan_log":
            findings = _scan_log(
                tree,
                path,
                min(int(request["max_bytes"]), MAX_SCAN_BYTES),
                request.get("step_pattern"),
                as_owner=as_owner,
            )
            return {"ok": to_json(findings)}
        if request["op"] == "read_tail":
            data = _read_tail(tree, path, int(request["limit"]), as_owner=as_owner)
            return {"ok": base64.b64encode(data).decode("ascii")}
        if request["op"] == "find_last_good":
            return {"ok": _scan_to_json(_find_last_good(request, tree, as_owner=as_owner))}
        if request["op"] == "read_template":
            return {"ok": _read_template(tree, as_owner=as_owner)}
    except _Refuse as refusal:
        return _refused(refusal.kind, str(refusal))
    except LogReadError as error:
        return _refused(RefusalKind.FAILED, f"log not scanned: {error}")
    except (ValueError, ArithmeticError, LookupError, re.error) as error:
        # a bad request, or a parser tripped by what the file holds: a refusal either way
        return _refused(RefusalKind.FAILED, f"not read: {type(error).__name__}: {error}")
    except CheckpointError as error:
        return _refused(RefusalKind.UNUSABLE, str(error))
    except OSError as error:
        return _refused(RefusalKind.FAILED, f"{path}: {error.strerror or error}")
    except (MemoryError, RecursionError) as error:
        return _refused(RefusalKind.FAILED, f"the reader ran out of room: {type(error).__name__}")
    return _refused(RefusalKind.FAILED, f"unknown operation {request['op']!r}")


class _Refuse(Exception):
    """A read refused by the walk; `code` is the errno a file-system seam reports it as."""

    def __init__(self, kind: RefusalKind, reason: str, code: int = errno.EPERM) -> None:
        super().__init__(reason)
        self.kind = kind
        self.code = code

    def as_os_error(self) -> OSError:
        return OSError(self.code, str(self))


def _refused(kind: RefusalKind, reason: str) -> dict[str, Any]:
    return {"refused": {"kind": kind.value, "reason": reason}}


def _scan_log(
    tree: str, path: str, max_bytes: int, step_pattern: str | None, *, as_owner: bool
) -> LogFindings:
    """The scanner on the log's descriptor, opened by the walk: what the kernel let the owner
    open is what is read, and nothing is copied out of the file before the scanner reads it."""
    with _opened_tree(tree, as_owner=as_owner) as root:
        fd, _ = _open_in(root, path, want="file")
    try:
        return scan_log(fd, step_pattern=step_pattern, byte_budget=max_bytes)
    finally:
        os.close(fd)


def _read_tail(tree: str, path: str, limit: int, *, as_owner: bool) -> bytes:
    with _opened_tree(tree, as_owner=as_owner) as root:
        fd, _ = _open_in(root, path, want="file")
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - min(limit, MAX_TAIL_BYTES))
        return os.pread(fd, size - start, start)
    finally:
        os.close(fd)


def _find_last_good(request: dict[str, Any], tree: str, *, as_owner: bool) -> CheckpointScan:
    spec = CheckpointSpec(
        layout=CheckpointLayout(request["layout"]),
        root=str(request["path"]),
        glob=str(request.get("glob", "")),
        marker=str(request.get("marker", "")),
    )
    try:
        opened = _open_tree(tree, as_owner=as_owner)
    except _Refuse as refusal:
        if refusal.kind is RefusalKind.MISSING:
            return CheckpointScan(spec.root, None, (), "the checkpoint root does not exist yet")
        raise
    try:
        return find_last_good(spec, _TreeReader(opened))
    finally:
        os.close(opened.fd)


def _read_template(directory: str, *, as_owner: bool) -> dict[str, Any]:
    """Every file in one walk of the template's tree; the script's name (and the kept configs')
    comes from the TOML, so the TOML is parsed here too, by the owner's child."""
    with _opened_tree(directory, as_owner=as_owner) as root:
        toml_path = f"{directory.rstrip('/')}/{TEMPLATE_FILE}"
        toml_text = _decode(_read_file(root, TEMPLATE_FILE, "template.toml"), toml_path)
        try:
            document = tomllib.loads(toml_text)
        except (tomllib.TOMLDecodeError, RecursionError) as error:
            raise _Refuse(RefusalKind.UNUSABLE, f"cannot read {toml_path}: {error}") from error
        script = document.get("script")
        if not isinstance(script, str) or not script:
            raise _Refuse(RefusalKind.UNUSABLE, "template.toml needs a non-empty string `script`")
        if script.startswith("/") or ".." in script.split("/"):
            raise _Refuse(
                RefusalKind.OUTSIDE, f"script {script!r} must be a file inside {directory}"
            )
        script_path = f"{directory.rstrip('/')}/{script}"
        raw = _read_file(root, script, "script")
        if b"\0" in raw:
            raise _Refuse(RefusalKind.UNUSABLE, f"{script_path} is not a script (binary)")
        if document.get("imported") is True:  # the user's own script, kept byte for byte
            return {
                "toml": toml_text,
                "script": raw.decode("utf-8", "surrogateescape"),
                "configs": _read_configs(root, directory, document.get("configs", {})),
            }
        return {"toml": toml_text, "script": _decode(raw, script_path)}


def _read_configs(root: _Tree, directory: str, table: object) -> dict[str, str]:
    """The config files an imported template keeps (`[configs]`: path -> file), read as its
    script is: inside the directory, capped, text only, bytes that are not UTF-8 kept."""
    if not isinstance(table, dict):
        raise _Refuse(RefusalKind.UNUSABLE, "template.toml: [configs] must be a table")
    if len(table) > MAX_TEMPLATE_CONFIGS:
        raise _Refuse(
            RefusalKind.UNUSABLE, f"[configs] names more than {MAX_TEMPLATE_CONFIGS} files"
        )
    texts: dict[str, str] = {}
    total = 0
    for name in table.values():
        if not isinstance(name, str) or not name:
            raise _Refuse(RefusalKind.UNUSABLE, "[configs] values must be non-empty strings")
        if name.startswith("/") or ".." in name.split("/"):
            raise _Refuse(RefusalKind.OUTSIDE, f"config {name!r} must be a file inside {directory}")
        raw = _read_file(root, name, "config")
        total += len(raw)
        if total > MAX_TEMPLATE_CONFIG_BYTES:
            raise _Refuse(
                RefusalKind.TOO_LARGE,
                f"the configs are over {MAX_TEMPLATE_CONFIG_BYTES} bytes together",
                errno.EFBIG,
            )
        if b"\0" in raw:
            raise _Refuse(RefusalKind.UNUSABLE, f"{directory.rstrip('/')}/{name} is binary")
        texts[name] = raw.decode("utf-8", "surrogateescape")
    return texts


def _read_file(root: _Tree, name: str, what: str) -> bytes:
    fd, _ = _open_in(root, name, want="file")
    try:
        return _read_capped(fd, MAX_TEMPLATE_FILE_BYTES, f"the {what} {name!r}")
    finally:
        os.close(fd)


def _decode(raw: bytes, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _Refuse(RefusalKind.UNUSABLE, f"{path} is not UTF-8: {error}") from error


def _read_capped(fd: int, cap: int, what: str) -> bytes:
    """The whole file, refused from its size when over `cap`; never more than cap + 1 bytes."""
    size = os.fstat(fd).st_size
    if size > cap:
        raise _Refuse(
            RefusalKind.TOO_LARGE, f"{what} is {size} bytes, over the {cap}-byte cap", errno.EFBIG
        )
    chunks: list[bytes] = []
    total = 0
    while total <= cap:
        chunk = os.read(fd, cap + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > cap:
        raise _Refuse(RefusalKind.TOO_LARGE, f"{what} grew over the {cap}-byte cap", errno.EFBIG)
    return b"".join(chunks)


# -------------------------------------------------------------------------------- the walk


@dataclass(frozen=True)
class _Tree:
    """An opened tree: its directory (an O_PATH descriptor), how the caller named it, the path
    the walk took to it, and whether links inside it may be followed (the owner's read)."""

    fd: int
    named: tuple[str, ...]
    real: tuple[str, ...]
    follow_links: bool

    def describe(self) -> str:
        return "/" + "/".join(self.named)


Want = Literal["file", "dir", "any"]


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _under(parts: list[str], prefix: list[str] | tuple[str, ...]) -> list[str] | None:
    """The rest of `parts` below `prefix`, or None when `parts` does not start with it."""
    head = parts[: len(prefix)]
    if len(head) < len(prefix) or head != list(prefix) or ".." in head:
        return None
    return parts[len(prefix) :]


def _open_tree(path: str, *, as_owner: bool) -> _Tree:
    """Walk from `/` to the tree, following only links root owns (or the owner, as the owner)."""
    if not path.startswith("/"):
        raise _Refuse(RefusalKind.OUTSIDE, f"{path!r} is not an absolute path")
    link_owners = frozenset({0, os.geteuid()}) if as_owner else frozenset({0})
    top = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, real = _walk(top, _components(path), _AboveTree(path, link_owners), want="dir")
    except _Refuse as refusal:
        if refusal.code == errno.ENOTDIR:
            raise _Refuse(
                RefusalKind.UNUSABLE, f"{path} is not a directory", errno.ENOTDIR
            ) from refusal
        raise
    finally:
        os.close(top)
    return _Tree(fd, tuple(_components(os.path.normpath(path))), real, as_owner)


@contextmanager
def _opened_tree(path: str, *, as_owner: bool) -> Iterator[_Tree]:
    tree = _open_tree(path, as_owner=as_owner)
    try:
        yield tree
    finally:
        os.close(tree.fd)


def _open_in(tree: _Tree, path: str, *, want: Want) -> tuple[int, tuple[str, ...]]:
    """Open `path` (absolute and naming the tree, or relative to it) without leaving the tree;
    returns the descriptor and the real path's components."""
    parts = _components(path)
    if path.startswith("/"):
        rest = _under(parts, tree.named)
        if rest is None:
            rest = _under(parts, tree.real)
        if rest is None:
            raise _Refuse(RefusalKind.OUTSIDE, f"{path} is not inside {tree.describe()}")
        parts = rest
    fd, below = _walk(tree.fd, parts, _InsideTree(tree, path), want=want)
    return fd, tree.real + below


class _AboveTree:
    """Links on the way to a tree: followed when a trusted uid owns them; `..` stops at `/`."""

    def __init__(self, path: str, link_owners: frozenset[int]) -> None:
        self.path = path
        self.link_owners = link_owners

    def climb_out(self, *, after_link: bool) -> None:
        return  # `/..` is `/`

    def follow(self, name: str, owner_uid: int, target: str) -> tuple[bool, list[str]]:
        if owner_uid not in self.link_owners:
            raise _Refuse(
                RefusalKind.SYMLINK,
                f"{name!r} on the way to {self.path} is a symlink of uid {owner_uid}: only "
                "root's links, or the owner's own when read as the owner, are followed there",
                errno.EXDEV,
            )
        return target.startswith("/"), _components(target)


class _InsideTree:
    """Links inside a tree: only in the owner's read, and only while they stay inside."""

    def __init__(self, tree: _Tree, path: str) -> None:
        self.tree = tree
        self.path = path

    def climb_out(self, *, after_link: bool) -> None:
        raise _Refuse(
            RefusalKind.SYMLINK if after_link else RefusalKind.OUTSIDE,
            f"{self.path} climbs out of {self.tree.describe()} with `..`"
            + (" (through a symlink)" if after_link else ""),
            errno.EXDEV,
        )

    def follow(self, name: str, owner_uid: int, target: str) -> tuple[bool, list[str]]:
        if not self.tree.follow_links:
            raise _Refuse(
                RefusalKind.SYMLINK,
                f"{name!r} in {self.path} is a symlink and this read is not the owner's",
                errno.ELOOP,
            )
        parts = _components(target)
        if not target.startswith("/"):
            return False, parts
        rest = _under(parts, self.tree.named)
        if rest is None:
            rest = _under(parts, self.tree.real)
        if rest is None:
            raise _Refuse(
                RefusalKind.SYMLINK,
                f"{name!r} in {self.path} is a symlink leaving {self.tree.describe()} "
                f"(to {target[:200]})",
                errno.EXDEV,
            )
        return True, rest


def _walk(
    base: int, names: list[str], policy: _AboveTree | _InsideTree, *, want: Want
) -> tuple[int, tuple[str, ...]]:
    """Open `names` below the directory `base`, one `openat` per component, links handed to
    `policy`. Returns a descriptor (read-only for a file, O_PATH otherwise) the caller closes,
    and the components walked below `base`. `..` pops what this walk opened, never the
    kernel's idea of the parent, so a directory moved away cannot take the walk with it."""
    stack: list[tuple[str, int]] = []
    pending = deque(names)
    links = 0
    try:
        while pending:
            name = pending.popleft()
            if name == "..":
                if stack:
                    os.close(stack.pop()[1])
                else:
                    policy.climb_out(after_link=links > 0)
                continue
            parent = stack[-1][1] if stack else base
            last = not pending
            fd = _open_component(parent, name, read=last and want == "file")
            status = os.fstat(fd)
            if stat.S_ISLNK(status.st_mode):
                try:
                    target = os.readlink("", dir_fd=fd)
                finally:
                    os.close(fd)
                links += 1
                if links > MAX_SYMLINKS:
                    raise _Refuse(
                        RefusalKind.SYMLINK,
                        f"more than {MAX_SYMLINKS} symlinks (a loop?)",
                        errno.ELOOP,
                    )
                absolute, rest = policy.follow(name, status.st_uid, target)
                if absolute:
                    while stack:
                        os.close(stack.pop()[1])
                pending.extendleft(reversed(rest))
                continue
            if last:
                _check_kind(fd, status.st_mode, name, want)
                return fd, (*(entry for entry, _ in stack), name)
            if not stat.S_ISDIR(status.st_mode):
                os.close(fd)
                raise _Refuse(RefusalKind.UNUSABLE, f"{name!r} is not a directory", errno.ENOTDIR)
            stack.append((name, fd))
            if len(stack) > MAX_DEPTH:
                raise _Refuse(RefusalKind.UNUSABLE, f"deeper than {MAX_DEPTH} directories")
        if want == "file":
            raise _Refuse(RefusalKind.NOT_REGULAR, "a directory, not a file", errno.EISDIR)
        fd = stack.pop()[1] if stack else os.dup(base)
        return fd, tuple(entry for entry, _ in stack)
    finally:
        for _, opened in stack:
            os.close(opened)


def _open_component(parent: int, name: str, *, read: bool) -> int:
    """O_PATH for directories and links (search permission is enough, as for any lookup);
    a final file is opened for reading, non-blocking, so a FIFO answers at once."""
    try:
        return os.open(name, _READ_FLAGS if read else _PATH_FLAGS, dir_fd=parent)
    except OSError as error:
        if read and error.errno == errno.ELOOP:
            return _open_component(parent, name, read=False)  # the link itself, to follow it
        raise _Refuse(
            _ERRNO_KINDS.get(error.errno or 0, RefusalKind.FAILED),
            f"{name!r}: {error.strerror}",
            error.errno or errno.EIO,
        ) from error


_ERRNO_KINDS = {
    errno.EACCES: RefusalKind.DENIED,
    errno.EPERM: RefusalKind.DENIED,
    errno.ENOENT: RefusalKind.MISSING,
    errno.ENOTDIR: RefusalKind.UNUSABLE,
}


def _check_kind(fd: int, mode: int, name: str, want: Want) -> None:
    if want == "file" and not stat.S_ISREG(mode):
        os.close(fd)
        raise _Refuse(RefusalKind.NOT_REGULAR, f"{name!r} is not a regular file", errno.EINVAL)
    if want == "file" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH:
        # an O_PATH descriptor cannot be read: the name was a link a moment before
        os.close(fd)
        raise _Refuse(RefusalKind.FAILED, f"{name!r} changed while it was opened", errno.EAGAIN)
    if want == "dir" and not stat.S_ISDIR(mode):
        os.close(fd)
        raise _Refuse(RefusalKind.UNUSABLE, f"{name!r} is not a directory", errno.ENOTDIR)


class _TreeReader:
    """`checkpoints.CheckpointReader` over one opened tree: every call walks from its root."""

    def __init__(self, tree: _Tree) -> None:
        self.tree = tree

    def list_dir(self, path: Path) -> list[str]:
        fd = self._open(path, "dir")
        try:
            listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            return os.listdir(listing)
        finally:
            os.close(listing)

    def kind(self, path: Path) -> str:
        try:
            fd = self._open(path, "any")
        except FileNotFoundError:
            return "missing"
        except OSError:
            return "other"
        try:
            mode = os.fstat(fd).st_mode
        finally:
            os.close(fd)
        if stat.S_ISDIR(mode):
            return "dir"
        return "file" if stat.S_ISREG(mode) else "other"

    def resolve(self, path: Path) -> Path:
        try:
            fd, real = _open_in(self.tree, str(path), want="any")
        except _Refuse as refusal:
            raise refusal.as_os_error() from refusal
        os.close(fd)
        return Path("/" + "/".join(real))

    def read_bytes(self, path: Path, limit: int) -> bytes:
        fd = self._open(path, "file")
        try:
            return _read_capped(fd, limit, path.name)
        except _Refuse as refusal:
            raise refusal.as_os_error() from refusal
        finally:
            os.close(fd)

    def _open(self, path: Path, want: Want) -> int:
        try:
            return _open_in(self.tree, str(path), want=want)[0]
        except _Refuse as refusal:
            raise refusal.as_os_error() from refusal


# ------------------------------------------------------------------------- (de)serialising


def _scan_to_json(scan: CheckpointScan) -> dict[str, Any]:
    found = scan.found
    return {
        "root": scan.root,
        "reason": scan.reason,
        "skipped": [{"name": item.name, "reason": item.reason} for item in scan.skipped],
        "found": None
        if found is None
        else {
            "layout": found.layout.value,
            "path": str(found.path),
            "step": found.step,
            "resume_path": found.resume_path,
            "tag": found.tag,
        },
    }


def _scan_from_json(data: Any) -> CheckpointScan:
    found = data["found"]
    return CheckpointScan(
        root=str(data["root"]),
        found=None
        if found is None
        else Checkpoint(
            layout=CheckpointLayout(found["layout"]),
            path=Path(found["path"]),
            step=None if found["step"] is None else int(found["step"]),
            resume_path=str(found["resume_path"]),
            tag=None if found["tag"] is None else str(found["tag"]),
        ),
        skipped=tuple(Skipped(str(item["name"]), str(item["reason"])) for item in data["skipped"]),
        reason=str(data["reason"]),
    )


# -------------------------------------------------------------------------------- the child


def _limit_self(cpu_seconds: int) -> None:
    """Before any of the owner's bytes: whatever they hold can only exhaust this child."""
    limits = {
        resource.RLIMIT_AS: CHILD_MEMORY_BYTES,
        resource.RLIMIT_CPU: cpu_seconds,
        resource.RLIMIT_FSIZE: 0,
        resource.RLIMIT_NOFILE: CHILD_OPEN_FILES,
        resource.RLIMIT_CORE: 0,
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def _child_main(argv: list[str]) -> int:
    """The child's whole life: it already runs as the owner, so its reads are the owner's."""
    _limit_self(int(argv[1]) if len(argv) > 1 else math.ceil(DEFAULT_TIMEOUT_S) + 5)
    try:
        request = json.loads(sys.stdin.read(_MAX_REQUEST_CHARS))
        if not isinstance(request, dict) or "path" not in request or "op" not in request:
            raise ValueError("the request must be an object with op and path")
        reply = answer(request, as_owner=True)
    except (ValueError, KeyError, TypeError) as error:
        reply = _refused(RefusalKind.FAILED, f"bad request: {error}")
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv))
