"""The daemon's end of the EpilogSlurmctld hook: a unix datagram socket that wakes the poll.

slurmctld runs `deploy/epilog/slurm-medic-epilog` when a job ends; the hook sends the job's id,
and this listener tells the service at once instead of at the next poll. It only ever wakes
the poll: the accounting query stays the source of truth, so a lost, forged or repeated
datagram changes nothing but timing. Even so, a datagram is accepted only when it is a job id
and nothing else (ASCII digits, an optional newline), and, when `allowed_uids` is given, only
from those senders: the kernel attaches each sender's real uid (SO_PASSCRED), which a local
user cannot forge.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import stat
import struct
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

MAX_DATAGRAM = 64  # a job id is at most 20 characters; anything longer is not one
_JOB_ID = re.compile(rb"([0-9]{1,19})\n?\Z")
_UCRED = struct.Struct("3i")  # pid, uid, gid, as SCM_CREDENTIALS carries them
_POLL_S = 0.25  # how often the listening thread looks at the stop flag


class HookError(RuntimeError):
    """The socket cannot be set up (a non-socket file in its place, a directory missing...)."""


def parse_job_id(data: bytes) -> int | None:
    """The job id a hook datagram carries, or None if it is anything but one."""
    match = _JOB_ID.match(data)
    if match is None:
        return None
    job_id = int(match.group(1))
    return job_id if 0 < job_id < 2**63 else None


@dataclass
class HookStats:
    """What the listener has seen, for the log and the status page."""

    accepted: int = 0
    rejected: int = 0
    last_job_id: int | None = None


class HookListener:
    """Receives job ids on `path` in a thread and hands each valid one to `on_job`."""

    def __init__(
        self,
        path: Path,
        *,
        on_job: Callable[[int], None],
        allowed_uids: Collection[int] | None = None,
        mode: int = 0o666,
    ) -> None:
        self.path = path
        self.on_job = on_job
        self.allowed_uids = None if allowed_uids is None else frozenset(allowed_uids)
        self.mode = mode
        self.stats = HookStats()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Bind the socket (replacing a stale one, never another kind of file) and listen."""
        self._remove_stale_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(str(self.path))
            os.chmod(self.path, self.mode)
        except OSError as error:
            sock.close()
            raise HookError(f"cannot listen on {self.path}: {error.strerror}") from error
        sock.settimeout(_POLL_S)
        self._socket = sock
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name="slurm-medic-hook", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            self._remove_stale_socket()

    def __enter__(self) -> HookListener:
        self.start()
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _remove_stale_socket(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise HookError(f"{self.path} exists and is not a socket; not touching it")
        os.unlink(self.path)

    def _serve(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, flags, _address = sock.recvmsg(
                    MAX_DATAGRAM, socket.CMSG_SPACE(_UCRED.size)
                )
            except TimeoutError:
                continue
            except OSError as error:
                if error.errno in (errno.EBADF, errno.ENOTSOCK):
                    return
                log.warning("hook socket receive failed: %s", error)
                continue
            self._handle(data, ancillary, flags)

    def _handle(self, data: bytes, ancillary: list[tuple[int, int, bytes]], flags: int) -> None:
        uid = _sender_uid(ancillary)
        job_id = None if flags & socket.MSG_TRUNC else parse_job_id(data)
        if job_id is None or (self.allowed_uids is not None and uid not in self.allowed_uids):
            self.stats.rejected += 1
            log.warning("hook datagram refused (sender uid %s, %d bytes)", uid, len(data))
            return
        self.stats.accepted += 1
        self.stats.last_job_id = job_id
        try:
            self.on_job(job_id)
        except Exception:
            log.exception("hook callback failed for job %d; the poll will still find it", job_id)


def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            uid: int = _UCRED.unpack(payload[: _UCRED.size])[1]
            return uid
    return None
