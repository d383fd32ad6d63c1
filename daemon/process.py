"""The one subprocess seam: every external command slurm-medic runs goes through `run`.

Argv lists only (never a shell), a timeout on everything, and the whole process group
killed on timeout so that a hung `sacct` or `ssh` cannot leave children behind. What a command
prints is capped too (`max_output_bytes`, both streams together): the daemon runs children a
user can influence (the owner's reader runs as that user, who may ptrace it), and no child's
output may grow the daemon's memory without bound.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 30.0
# Far above what any command we run prints (a day of sacct --json for a busy cluster is tens
# of MB), far below what would hurt the daemon.
DEFAULT_MAX_OUTPUT_BYTES = 256 * 1024 * 1024
_KILL_GRACE_S = 2.0
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left: its argv, exit code, both streams and how long it took."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandError(Exception):
    """A command that could not start, failed, or timed out; carries what is needed to report it."""

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str],
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        code = "" if returncode is None else f" (exit {returncode})"
        super().__init__(
            f"{message}{code}: {' '.join(self.argv)}" + (f": {detail}" if detail else "")
        )


class CommandTimeout(CommandError):
    """The command ran past its timeout; its process group was killed."""


class CommandOutputTooLarge(CommandError):
    """The command printed more than it may; its process group was killed."""


def as_user_argv(uid: int, gid: int, argv: Sequence[str]) -> list[str]:
    """`argv` run as the user `uid`: real and effective ids, primary group and supplementary
    groups of that user, and no way back up (no_new_privs), so the kernel and every daemon the
    command talks to (slurmctld through munge) see only that user's rights. For root only."""
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--init-groups",
        "--no-new-privs",
        "--",
        *argv,
    ]


def run(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = False,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> CommandResult:
    """Run argv (no shell) in its own process group; kill the group if it outlives `timeout`
    or prints more than `max_output_bytes` (stdout and stderr together).

    Output is decoded as UTF-8 with replacement, so odd bytes in a job name never raise here.
    With `check`, a non-zero exit raises `CommandError`; a timeout always raises
    `CommandTimeout`, too much output `CommandOutputTooLarge`.
    """
    argv = tuple(argv)
    if not argv or not all(isinstance(part, str) for part in argv):
        raise TypeError(f"argv must be a non-empty sequence of str, got {argv!r}")
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as error:
        raise CommandError(f"cannot start command ({error.strerror})", argv=argv) from error
    stdin_bytes = input_text.encode() if input_text is not None else b""
    try:
        out, err = _collect(process, stdin_bytes, started + timeout, max_output_bytes)
    except _Stopped as stopped:
        _stop_group(process)
        error_type, message = (
            (CommandTimeout, f"timed out after {timeout:g}s")
            if stopped.timed_out
            else (CommandOutputTooLarge, f"printed more than {max_output_bytes} bytes")
        )
        raise error_type(
            message,
            argv=argv,
            stdout=stopped.out[:_CHUNK].decode(errors="replace"),
            stderr=stopped.err[-_CHUNK:].decode(errors="replace"),
        ) from None
    result = CommandResult(
        argv=argv,
        returncode=process.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        duration_s=time.monotonic() - started,
    )
    if check and not result.ok:
        raise CommandError(
            "command failed",
            argv=argv,
            returncode=result.returncode,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    return result


class _Stopped(Exception):
    """Collecting stopped early: the deadline passed, or the output outgrew its cap."""

    def __init__(self, *, timed_out: bool, out: bytes, err: bytes) -> None:
        super().__init__("timed out" if timed_out else "too much output")
        self.timed_out = timed_out
        self.out = out
        self.err = err


def _collect(
    process: subprocess.Popen[bytes], stdin_bytes: bytes, deadline: float, limit: int
) -> tuple[bytes, bytes]:
    """`communicate` with a cap: feed stdin, read both streams until they close and the
    process exits; `_Stopped` (with what was read) once the deadline passes or both streams
    together exceed `limit`."""
    streams = {s.fileno(): s for s in (process.stdout, process.stderr) if s is not None}
    chunks: dict[int, list[bytes]] = {fd: [] for fd in streams}

    def stopped(*, timed_out: bool) -> _Stopped:
        out_fd = process.stdout.fileno() if process.stdout is not None else -1
        err_fd = process.stderr.fileno() if process.stderr is not None else -1
        return _Stopped(
            timed_out=timed_out,
            out=b"".join(chunks.get(out_fd, [])),
            err=b"".join(chunks.get(err_fd, [])),
        )

    selector = selectors.DefaultSelector()
    received = 0
    pending = memoryview(stdin_bytes)
    if process.stdin is not None:
        if pending:
            selector.register(process.stdin, selectors.EVENT_WRITE)
        else:
            process.stdin.close()
    for stream in streams.values():
        selector.register(stream, selectors.EVENT_READ)
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise stopped(timed_out=True)
            for key, _events in selector.select(left):
                if process.stdin is not None and key.fileobj is process.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:_CHUNK]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(process.stdin)
                        process.stdin.close()
                    continue
                data = os.read(key.fd, _CHUNK)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fd].append(data)
                received += len(data)
                if received > limit:
                    raise stopped(timed_out=False)
    finally:
        selector.close()
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise stopped(timed_out=True) from None
    out_fd = process.stdout.fileno() if process.stdout is not None else -1
    err_fd = process.stderr.fileno() if process.stderr is not None else -1
    result = b"".join(chunks.get(out_fd, [])), b"".join(chunks.get(err_fd, []))
    for stream in streams.values():
        stream.close()
    return result


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """Close our ends of the pipes (a flood then meets SIGPIPE, never our memory), SIGTERM
    the process group, then SIGKILL it if it lingers."""
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None and not stream.closed:
            stream.close()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=_KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    process.wait()
