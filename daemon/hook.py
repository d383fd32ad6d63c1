"""The daemon's end of the EpilogSlurmctld hook: a unix datagram socket that wakes the poll.

slurmctld runs the hook (`daemon/installable/epilog.py`) when a job ends; it sends the job's id,
and this listener tells the service at once instead of at the next poll. It only ever wakes
the poll: the accounting query stays the source of truth, so a lost, forged or repeated
datagram changes nothing but timing. Even so, a datagram is accepted only when it is a job id
and nothing else (ASCII digits, an optional newline), and, when `allowed_uids` is given, only
from those senders: the kernel attaches each sender's real uid (SO_PASSCRED), which a local
user cannot forge; the others are dropped and counted. The socket file itself is writable only
by its owner and, when `group` is given, that group (the SlurmUser's), so other users cannot
even send. Wake-ups are coalesced: however many datagrams arrive, `on_job` runs at most once
per `min_wake_interval_s` (the latest job id; the rest are counted as coalesced), so a burst
of job ends, or a flood, costs at most one extra cycle per interval.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

MAX_DATAGRAM = 64  # a job id is at most 20 characters; anything longer is not one
_JOB_ID = re.compile(rb"([1-9][0-9]{0,18})\n?\Z")  # no leading zero: one spelling per id
_UCRED = struct.Struct("3i")  # pid, uid, gid, as SCM_CREDENTIALS carries them
_POLL_S = 0.25  # how often the listening thread looks at the stop flag
# Write for the owner and the group: only root and the SlurmUser may send (execute and read
# mean nothing on a socket file).
OWNER_AND_GROUP_MODE = 0o620
OWNER_ONLY_MODE = 0o600
_SLURM_USER = re.compile(r"^SlurmUser\s*=\s*(?P<name>[^\s(]+)\((?P<uid>[0-9]{1,10})\)\s*\Z")


class HookError(RuntimeError):
    """The socket cannot be set up (a non-socket file in its place, a directory missing...)."""


def parse_job_id(data: bytes) -> int | None:
    """The job id a hook datagram carries, or None if it is anything but one."""
    match = _JOB_ID.match(data)
    if match is None:
        return None
    job_id = int(match.group(1))
    return job_id if 0 < job_id < 2**63 else None


def parse_slurm_user(show_config: str) -> tuple[str, int] | None:
    """The SlurmUser (name, uid) from `scontrol show config`: the EpilogSlurmctld runs as it."""
    for line in show_config.splitlines():
        match = _SLURM_USER.match(line.strip())
        if match is not None:
            return match.group("name"), int(match.group("uid"))
    return None


@dataclass
class HookStats:
    """What the listener has seen, for the log and the status page."""

    accepted: int = 0
    rejected: int = 0  # every datagram dropped: not a job id, or from a sender not allowed
    foreign: int = 0  # of those, the ones from a sender not allowed
    coalesced: int = 0  # accepted, but folded into a wake-up already made or due
    woken: int = 0
    last_job_id: int | None = None


class HookListener:
    """Receives job ids on `path` in a thread and hands each valid one to `on_job`."""

    def __init__(
        self,
        path: Path,
        *,
        on_job: Callable[[int], None],
        allowed_uids: Collection[int] | None = None,
        group: int | None = None,
        min_wake_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.on_job = on_job
        self.allowed_uids = None if allowed_uids is None else frozenset(allowed_uids)
        self.group = group
        self.mode = OWNER_ONLY_MODE if group is None else OWNER_AND_GROUP_MODE
        self.min_wake_interval_s = min_wake_interval_s
        self.stats = HookStats()
        self._clock = clock
        self._next_wake = float("-inf")
        self._pending: int | None = None  # the latest job id not yet handed to on_job
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Bind the socket (replacing a stale one, never another kind of file) and listen."""
        self._remove_stale_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            # bind makes the file with the socket's own mode less the umask: 0600 from the
            # start, so nobody can send before the chmod below opens it to the group.
            os.fchmod(sock.fileno(), OWNER_ONLY_MODE)
            if self.group is None:
                sock.bind(str(self.path))
            else:
                _bind_in_group(sock, self.path, self.group)
            os.chmod(self.path, self.mode)
        except OSError as error:
            sock.close()
            raise HookError(f"cannot listen on {self.path}: {error.strerror}") from error
        except HookError:
            sock.close()
            raise
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
            self._wake_if_due()
            sock.settimeout(self._wait_s())
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

    def _wait_s(self) -> float:
        """Until the next look at the stop flag, or sooner when a coalesced wake-up is due."""
        if self._pending is None:
            return _POLL_S
        return min(_POLL_S, max(self._next_wake - self._clock(), 0.001))

    def _handle(self, data: bytes, ancillary: list[tuple[int, int, bytes]], flags: int) -> None:
        uid = _sender_uid(ancillary)
        if self.allowed_uids is not None and uid not in self.allowed_uids:
            self.stats.rejected += 1
            self.stats.foreign += 1
            if self.stats.foreign == 1 or self.stats.foreign % 1000 == 0:
                log.warning(
                    "hook datagrams from senders not allowed dropped (uid %s; %d so far)",
                    uid,
                    self.stats.foreign,
                )
            return
        job_id = None if flags & socket.MSG_TRUNC else parse_job_id(data)
        if job_id is None:
            self.stats.rejected += 1
            log.warning("hook datagram refused (sender uid %s, %d bytes)", uid, len(data))
            return
        self.stats.accepted += 1
        self.stats.last_job_id = job_id
        if self._pending is not None:
            self.stats.coalesced += 1
        self._pending = job_id
        self._wake_if_due()

    def _wake_if_due(self) -> None:
        """Hand the latest job id over, unless a wake-up was made less than the interval ago
        (then it waits for the interval's end, and later ids replace it)."""
        if self._pending is None:
            return
        now = self._clock()
        if now < self._next_wake:
            return
        job_id, self._pending = self._pending, None
        self._next_wake = now + self.min_wake_interval_s
        self.stats.woken += 1
        try:
            self.on_job(job_id)
        except Exception:
            log.exception("hook callback failed for job %d; the poll will still find it", job_id)


def _bind_in_group(sock: socket.socket, path: Path, gid: int) -> None:
    """Bind so that the socket file belongs to group `gid`.

    The service keeps CAP_SETGID but not CAP_CHOWN (which would let root take any file), so
    the file is made in the group from the start: the binding thread's filesystem gid is set
    to `gid` for the bind (setfsgid changes the calling thread only, unlike setgid). Where
    that is not allowed, a chown to a group the process is in still works.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    previous = int(libc.setfsgid(gid))
    try:
        sock.bind(str(path))
    finally:
        libc.setfsgid(previous)
    if os.stat(path).st_gid == gid:
        return
    try:
        os.chown(path, -1, gid)
    except PermissionError as error:
        raise HookError(
            f"cannot give {path} to group {gid}: neither CAP_SETGID nor membership of it"
        ) from error


def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            uid: int = _UCRED.unpack(payload[: _UCRED.size])[1]
            return uid
    return None
