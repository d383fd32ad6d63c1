"""Errors of the Slurm layer, kept apart so that callers can tell what went wrong where.

A submission failure is never a job failure, and a dead controller is never a parse error:
each gets its own type so that the daemon reacts to the right thing.
"""

from __future__ import annotations

from collections.abc import Sequence


class SlurmError(Exception):
    """Base of every error the Slurm layer raises."""


# How much of the offending text and of the reason an error keeps: a hostile record of
# megabytes must not become a log line of megabytes.
EXCERPT_CHARS = 200
REASON_CHARS = 800


class SlurmParseError(SlurmError):
    """Slurm printed something this code cannot read; `source` names the command or format.

    The only error the parsers of Slurm output raise (see `daemon.slurm.hostlist`,
    `daemon.slurm.sacct`, `daemon.slurm.scontrol`).
    """

    def __init__(self, message: str, *, source: str, excerpt: str = "") -> None:
        self.source = source
        self.reason = message[:REASON_CHARS]
        self.excerpt = excerpt[:EXCERPT_CHARS]
        detail = f" (near {self.excerpt!r})" if self.excerpt else ""
        super().__init__(f"cannot parse {source}: {self.reason}{detail}")


class SlurmCommandError(SlurmError):
    """A Slurm command exited non-zero; carries its argv, exit code, stderr and stdout.

    stdout too, because some answers come there with a failing exit: scontrol prints
    "Node nosuchnode not found" on stdout and exits 1, on every release.
    """

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str],
        returncode: int | None,
        stderr: str,
        stdout: str = "",
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        code = "no exit code" if returncode is None else f"exit {returncode}"
        said = stderr.strip() or stdout.strip()
        last_line = said.splitlines()[-1] if said else ""
        super().__init__(
            f"{message} ({code}): {' '.join(self.argv)}" + (f": {last_line}" if last_line else "")
        )


class SubmissionError(SlurmCommandError):
    """sbatch refused or failed to submit: no job exists (unless `maybe_submitted` says so).

    `maybe_submitted` is true when sbatch timed out: the controller may have accepted the job
    before the answer was lost, so the caller must reconcile by the job's comment token
    instead of submitting again.
    """

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str],
        returncode: int | None,
        stderr: str,
        maybe_submitted: bool = False,
    ) -> None:
        self.maybe_submitted = maybe_submitted
        super().__init__(message, argv=argv, returncode=returncode, stderr=stderr)


class SlurmUnavailable(SlurmError):
    """slurmctld or slurmdbd did not answer after the configured retries."""

    def __init__(
        self, message: str, *, argv: Sequence[str], attempts: int, last_error: str
    ) -> None:
        self.argv = tuple(argv)
        self.attempts = attempts
        self.last_error = last_error
        super().__init__(
            f"{message} after {attempts} attempt(s): {' '.join(self.argv)}: {last_error}"
        )


class JobNotFound(SlurmError):
    """Neither accounting nor the controller knows the job id."""


class NodeNotFound(SlurmError):
    """The controller does not know the node name."""


class OperationRefused(SlurmError):
    """A node operation that would break drain etiquette (clear or overwrite another's drain)."""
