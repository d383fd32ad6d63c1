"""The one subprocess seam: every external command slurm-medic runs goes through `run`.

Argv lists only (never a shell), a timeout on everything, and the whole process group
killed on timeout so that a hung `sacct` or `ssh` cannot leave children behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 30.0
_KILL_GRACE_S = 2.0


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


def run(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = False,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> CommandResult:
    """Run argv (no shell) in its own process group; kill the group if it outlives `timeout`.

    Output is decoded as UTF-8 with replacement, so odd bytes in a job name never raise here.
    With `check`, a non-zero exit raises `CommandError`; a timeout always raises `CommandTimeout`.
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
    stdin_bytes = input_text.encode() if input_text is not None else None
    try:
        out, err = process.communicate(stdin_bytes, timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _kill_group(process)
        raise CommandTimeout(
            f"timed out after {timeout:g}s",
            argv=argv,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
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


def _kill_group(process: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGTERM the process group, then SIGKILL it if it lingers; collect what it printed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            return process.communicate(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    # A descendant that left the group still holds the pipes: stop waiting for them.
    process.wait()
    return b"", b""
