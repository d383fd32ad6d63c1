"""Read a job's files with the job owner's rights, never with the daemon's.

The daemon runs as root so that it can submit as owners and drain nodes; root may read every
file, and a job's output directory is the owner's to fill with anything, a symlink to
`/etc/shadow` included. So every read of a job's log, checkpoints or receipt happens in a
short-lived child that has become the owner (`setpriv --reuid --regid --init-groups`, through
the one subprocess seam) before it opens anything: the kernel, not our checks, says what the
owner may read. The child answers one JSON request with one JSON line.

Not running as root, the daemon reads in its own process with its own rights; it follows a
final symlink only when it is the owner itself (the rights are then the owner's anyway).

Whatever the cause (no permission, a symlink the owner cannot follow, a FIFO, a directory, a
timeout, an owner without a uid), the caller gets `OwnerReadRefused` with a typed `Refusal` to
put on the record, never the content.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from daemon.checkpoints import (
    Checkpoint,
    CheckpointError,
    CheckpointLayout,
    CheckpointScan,
    CheckpointSpec,
    Skipped,
    find_last_good,
)
from daemon.evidence.joblog import LogReadError, scan_log
from daemon.evidence.records import LogFindings
from daemon.process import CommandError, CommandTimeout, run
from daemon.store.codec import CodecError, from_json, to_json

DEFAULT_TIMEOUT_S = 60.0
MAX_TAIL_BYTES = 16 * 1024 * 1024
_CHILD_MODULE = "daemon.owner_files"
_CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


class RefusalKind(StrEnum):
    DENIED = "denied"  # the owner may not read it
    NOT_REGULAR = "not_regular"  # a FIFO, a device, a directory, a socket
    MISSING = "missing"
    SYMLINK = "symlink"  # a final symlink, refused when not reading as the owner
    UNUSABLE = (
        "unusable"  # exists, but not as the operation needs (a checkpoint root that is a file)
    )
    NO_OWNER = "no_owner"  # the job's owner has no known uid here
    TIMEOUT = "timeout"
    FAILED = "failed"  # the reading child itself broke


@dataclass(frozen=True)
class Refusal:
    """Why a job's file was not read, in words for the record."""

    kind: RefusalKind
    path: str
    owner: str
    reason: str


class OwnerReadRefused(Exception):
    """A read as the job's owner that gave no content; `refusal` belongs on the record."""

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
    def for_job(cls, *, user: str, uid: int | None) -> Owner:
        """The owner of a job record; without a uid nothing is read (never as root instead)."""
        if uid is None:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", user, "the job record has no uid")
            )
        return cls.from_uid(uid)


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
        self.drop_privileges = os.geteuid() == 0 if drop_privileges is None else drop_privileges

    def scan_log(self, path: str, *, step_pattern: str | None = None) -> LogFindings:
        """The job-log scanner's findings for `path`, read with the owner's rights."""
        answer = self._ask({"op": "scan_log", "path": path, "step_pattern": step_pattern})
        try:
            return from_json(LogFindings, answer)
        except CodecError as error:
            raise self._failed(path, f"unreadable findings from the reader: {error}") from error

    def read_tail(self, path: str, limit: int) -> bytes:
        """The last `limit` bytes of a regular file (at most `MAX_TAIL_BYTES`)."""
        if not 0 < limit <= MAX_TAIL_BYTES:
            raise ValueError(f"limit must be in 1..{MAX_TAIL_BYTES}, got {limit}")
        answer = self._ask({"op": "read_tail", "path": path, "limit": limit})
        if not isinstance(answer, str):
            raise self._failed(path, "the reader did not return bytes")
        return base64.b64decode(answer)

    def find_last_good(self, spec: CheckpointSpec) -> CheckpointScan:
        """`checkpoints.find_last_good` run whole as the owner (one child, not one per file)."""
        request = {
            "op": "find_last_good",
            "path": spec.root,
            "layout": spec.layout.value,
            "glob": spec.glob,
            "marker": spec.marker,
        }
        try:
            return _scan_from_json(self._ask(request))
        except (KeyError, TypeError, ValueError) as error:
            raise self._failed(spec.root, f"unreadable scan from the reader: {error}") from error

    def _ask(self, request: dict[str, Any]) -> Any:
        if not self.drop_privileges:
            follow = os.geteuid() == self.owner.uid
            return _unwrap(answer(request, follow_symlinks=follow), request, self.owner)
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
            "-m",
            _CHILD_MODULE,
        ]
        path = str(request["path"])
        try:
            result = run(
                argv,
                timeout=self.timeout_s,
                input_text=json.dumps(request),
                env=_CHILD_ENV,
                cwd="/",
            )
        except CommandTimeout as error:
            raise OwnerReadRefused(
                Refusal(
                    RefusalKind.TIMEOUT, path, self.owner.name, f"no answer in {self.timeout_s:g}s"
                )
            ) from error
        except CommandError as error:
            raise self._failed(path, str(error)) from error
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            detail = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
            raise self._failed(path, f"the reading child failed: {detail[0]}")
        try:
            reply = json.loads(lines[-1])
        except json.JSONDecodeError as error:
            raise self._failed(path, f"the reading child's answer is not JSON: {error}") from error
        return _unwrap(reply, request, self.owner)

    def _failed(self, path: str, reason: str) -> OwnerReadRefused:
        return OwnerReadRefused(Refusal(RefusalKind.FAILED, path, self.owner.name, reason))


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


def answer(request: dict[str, Any], *, follow_symlinks: bool) -> dict[str, Any]:
    """Serve one request with this process's rights: `{"ok": ...}` or `{"refused": ...}`."""
    path = str(request["path"])
    try:
        if request["op"] == "scan_log":
            findings = scan_log(
                path, step_pattern=request.get("step_pattern"), follow_symlinks=follow_symlinks
            )
            return {"ok": to_json(findings)}
        if request["op"] == "read_tail":
            data = _read_tail(path, int(request["limit"]), follow_symlinks=follow_symlinks)
            return {"ok": base64.b64encode(data).decode("ascii")}
        if request["op"] == "find_last_good":
            return {"ok": _scan_to_json(_find_last_good(request, path, follow_symlinks))}
    except _Refuse as refusal:
        return _refused(refusal.kind, str(refusal))
    except LogReadError as error:
        return _refused(_kind_of_log_error(str(error)), str(error))
    except CheckpointError as error:
        return _refused(RefusalKind.UNUSABLE, str(error))
    return _refused(RefusalKind.FAILED, f"unknown operation {request['op']!r}")


class _Refuse(Exception):
    def __init__(self, kind: RefusalKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def _refused(kind: RefusalKind, reason: str) -> dict[str, Any]:
    return {"refused": {"kind": kind.value, "reason": reason}}


def _kind_of_log_error(message: str) -> RefusalKind:
    """The scanner says why in words; map them onto the kinds the record filters on."""
    if "symlink" in message:
        return RefusalKind.SYMLINK
    if "not a regular file" in message:
        return RefusalKind.NOT_REGULAR
    if os.strerror(errno.ENOENT) in message:
        return RefusalKind.MISSING
    if os.strerror(errno.EACCES) in message or os.strerror(errno.EPERM) in message:
        return RefusalKind.DENIED
    return RefusalKind.FAILED


def _open_regular(path: str, *, follow_symlinks: bool) -> int:
    """O_NONBLOCK so a FIFO cannot block the open; anything but a regular file is refused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        kinds = {
            errno.EACCES: RefusalKind.DENIED,
            errno.EPERM: RefusalKind.DENIED,
            errno.ENOENT: RefusalKind.MISSING,
            errno.ELOOP: RefusalKind.SYMLINK,
        }
        raise _Refuse(kinds.get(error.errno or 0, RefusalKind.FAILED), str(error)) from error
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Refuse(RefusalKind.NOT_REGULAR, f"{path} is not a regular file")
    return fd


def _read_tail(path: str, limit: int, *, follow_symlinks: bool) -> bytes:
    fd = _open_regular(path, follow_symlinks=follow_symlinks)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - min(limit, MAX_TAIL_BYTES))
        return os.pread(fd, size - start, start)
    finally:
        os.close(fd)


def _find_last_good(request: dict[str, Any], path: str, follow_symlinks: bool) -> CheckpointScan:
    if not follow_symlinks and Path(path).is_symlink():
        raise _Refuse(RefusalKind.SYMLINK, f"{path} is a symlink and this read is not the owner's")
    spec = CheckpointSpec(
        layout=CheckpointLayout(request["layout"]),
        root=path,
        glob=str(request.get("glob", "")),
        marker=str(request.get("marker", "")),
    )
    return find_last_good(spec)


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


def _child_main() -> int:
    """The child's whole life: it already runs as the owner, so following a symlink is safe."""
    try:
        request = json.loads(sys.stdin.read(1024 * 1024))
        if not isinstance(request, dict) or "path" not in request or "op" not in request:
            raise ValueError("the request must be an object with op and path")
        reply = answer(request, follow_symlinks=True)
    except (ValueError, KeyError, TypeError) as error:
        reply = _refused(RefusalKind.FAILED, f"bad request: {error}")
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
