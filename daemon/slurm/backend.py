"""The Slurm backend protocol and its CLI implementation (builders + the seam + parsers).

`SlurmBackend` is what the daemon uses; `SlurmCli` is the backend tested against the real
22.05 cluster. A pyslurm backend can sit behind the same protocol once a Slurm release that
pyslurm builds against is available.

Some 520 lines in one piece: every method is one Slurm command built, run through the seam
with the same retries and timeout, and parsed; the parsers and builders already live in their
own modules (`sacct*`, `scontrol`, `squeue`, `sbatch`).
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, tzinfo
from typing import Protocol

from daemon import process
from daemon.process import CommandError, CommandResult, CommandTimeout
from daemon.slurm.errors import (
    JobNotFound,
    NodeNotFound,
    OperationRefused,
    SlurmCommandError,
    SlurmParseError,
    SlurmUnavailable,
    SubmissionError,
)
from daemon.slurm.records import (
    MEDIC_REASON_PREFIX,
    JobState,
    JobWindow,
    PathSource,
    QueuedJob,
    RejectedRecord,
    SlurmJob,
    SlurmNode,
)
from daemon.slurm.sacct import (
    JsonDialect,
    SacctReport,
    sacct_job_argv,
    sacct_jobs_argv,
    sacct_window_argv,
    validate_job_id,
)
from daemon.slurm.sacct_json import parse_sacct_json
from daemon.slurm.sacct_parsable import fill_exit_codes, parse_sacct_parsable
from daemon.slurm.sbatch import (
    SubmitRequest,
    parse_sbatch_parsable,
    sbatch_argv,
    scancel_argv,
    submission_environment,
    submitter_ids,
)
from daemon.slurm.scontrol import (
    drain_argv,
    parse_show_job,
    parse_show_nodes,
    resume_argv,
    show_job_argv,
    show_node_argv,
    validate_reason,
)
from daemon.slurm.sdiag import SDIAG_ARGV, parse_dbd_agent_queue
from daemon.slurm.squeue import QUEUE_JSON_ARGV, parse_queue_json

log = logging.getLogger(__name__)

FINISHED_STATES: frozenset[JobState] = frozenset(
    {
        JobState.FAILED,
        JobState.OUT_OF_MEMORY,
        JobState.NODE_FAIL,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.COMPLETED,
    }
)

# stderr lines that mean "slurmctld or slurmdbd did not answer", worth a retry.
_UNAVAILABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|"
    r"Connection timed out|Problem talking to the database|Zero Bytes were transmitted|"
    r"Communication connection failure|Unable to establish|Could not establish a configuration|"
    r"slurmdbd: Connection|Transport endpoint is not connected",
    re.IGNORECASE,
)
_NO_JSON = re.compile(r"unrecognized option '--json'|invalid option", re.IGNORECASE)
_UNKNOWN_JOB = re.compile(r"Invalid job id specified", re.IGNORECASE)
_UNKNOWN_NODE = re.compile(r"Node .* not found|Invalid node name", re.IGNORECASE)
# Job ids per `sacct --jobs` call: a short argv, and a poll's usual handful in one call.
JOBS_PER_CALL = 100


class CommandRunner(Protocol):
    """The shape of `daemon.process.run`, so tests can wrap the real seam (count its calls)."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult: ...


class SlurmBackend(Protocol):
    """What slurm-medic asks of Slurm, whichever way it reaches it."""

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = FINISHED_STATES
    ) -> tuple[SlurmJob, ...]: ...

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = FINISHED_STATES
    ) -> JobWindow: ...

    def running_jobs(self, *, users: Iterable[str] = ()) -> tuple[SlurmJob, ...]: ...

    def job(self, job_id: int | str) -> SlurmJob: ...

    def jobs(self, job_ids: Iterable[int]) -> tuple[SlurmJob, ...]: ...

    def queued_jobs(self) -> tuple[QueuedJob, ...]: ...

    def accounting_backlog(self) -> int: ...

    def submit(
        self,
        script: str,
        *,
        as_user: str,
        comment: str | None = None,
        exclude_nodes: Iterable[str] = (),
        extra_args: Sequence[str] = (),
        work_dir: str | None = None,
    ) -> int: ...

    def cancel(self, job_id: int | str, signal: str | None = None) -> None: ...

    def drain(self, node: str, reason: str) -> None: ...

    def resume(self, node: str) -> None: ...

    def node(self, name: str) -> SlurmNode: ...

    def nodes(self) -> tuple[SlurmNode, ...]: ...


class SlurmCli:
    """The backend over Slurm's own commands; every call goes through the subprocess seam.

    Reads are retried `attempts` times with exponential backoff when slurmctld/slurmdbd does
    not answer, then `SlurmUnavailable`; the worst case is bounded by
    `attempts * timeout_s + backoff_s * (2**(attempts-1) - 1)`. Submissions are never
    retried: a lost answer may hide an accepted job. `json_output=False` reads sacct's
    `--parsable2` from the start (it is also the automatic fallback where `--json` is missing).
    """

    def __init__(
        self,
        *,
        runner: CommandRunner = process.run,
        timeout_s: float = 30.0,
        attempts: int = 3,
        backoff_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        env: Mapping[str, str] | None = None,
        euid: int | None = None,
        local_tz: tzinfo | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        json_output: bool = True,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self._runner = runner
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._sleep = sleep
        self._env = dict(env) if env is not None else None
        self._euid = os.geteuid() if euid is None else euid
        self._local_tz = local_tz
        self._clock = clock
        self._json = json_output

    # -- jobs -------------------------------------------------------------------------------

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = FINISHED_STATES
    ) -> tuple[SlurmJob, ...]:
        """Every job that ended in `states` inside the window: one sacct call, steps included."""
        return self.finished_window(since, until, states).jobs

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = FINISHED_STATES
    ) -> JobWindow:
        """`finished_jobs` with the records the parser could not read, each with its text: a
        window holding only unreadable records is that, not an error, so a poll moves on."""
        wanted = frozenset(states)
        report = self._sacct(
            lambda json_output: sacct_window_argv(
                since=since,
                until=until,
                states=wanted,
                json_output=json_output,
                local_tz=self._local_tz,
            )
        )
        return JobWindow(tuple(job for job in report.jobs if job.state in wanted), report.rejected)

    def running_jobs(self, *, users: Iterable[str] = ()) -> tuple[SlurmJob, ...]:
        """Jobs running now (optionally only these users'), from one sacct call."""
        now = self._clock()
        user_list = tuple(users)
        report = self._sacct(
            lambda json_output: sacct_window_argv(
                since=now,
                until=now,
                states=(JobState.RUNNING,),
                users=user_list,
                json_output=json_output,
                local_tz=self._local_tz,
            )
        )
        return tuple(job for job in report.jobs if job.state is JobState.RUNNING)

    def job(self, job_id: int | str) -> SlurmJob:
        """One job from accounting, with std paths from slurmctld where accounting lacks them."""
        text_id = validate_job_id(job_id)
        report = self._sacct(lambda json_output: sacct_job_argv(text_id, json_output=json_output))
        found = _asked_for(report, [text_id])
        unreadable = [record for record in report.rejected if record.record_id == text_id]
        if not found and unreadable:
            record = unreadable[0]
            raise SlurmParseError(record.reason, source=record.source, excerpt=record.excerpt)
        if not found:
            raise JobNotFound(f"accounting has no job {text_id}")
        return self._completed(found, report.dialect)[0]

    def jobs(self, job_ids: Iterable[int]) -> tuple[SlurmJob, ...]:
        """Each of these jobs that accounting can read, completed as `job` completes one, in
        one sacct call per JOBS_PER_CALL ids (and one --parsable2 call beside it on 22.05);
        an id accounting does not know, or whose record it cannot read, is left out."""
        text_ids = list(dict.fromkeys(validate_job_id(job_id) for job_id in job_ids))
        found: list[SlurmJob] = []
        for start in range(0, len(text_ids), JOBS_PER_CALL):
            chunk = text_ids[start : start + JOBS_PER_CALL]
            report = self._sacct_jobs(chunk)
            found += self._completed(_asked_for(report, chunk), report.dialect)
        return tuple(found)

    def _sacct_jobs(self, text_ids: Sequence[str]) -> SacctReport:
        return self._sacct(lambda json_output: sacct_jobs_argv(text_ids, json_output=json_output))

    def _completed(
        self, jobs: Sequence[tuple[str, SlurmJob]], dialect: JsonDialect | None
    ) -> list[SlurmJob]:
        """Fill what the release's accounting lacks: exit codes (22.05's JSON, one call for
        every job) and std paths (slurmctld, one call per job: `scontrol show job` takes one
        id, and its text for many jobs could be forged by a job name holding a newline)."""
        lacking = [text_id for text_id, job in jobs if job.exit_code is None]
        fallback: dict[int, SlurmJob] = {}
        if dialect is JsonDialect.DBV0_0_38 and lacking:
            argv = sacct_jobs_argv(lacking, json_output=False)
            report = parse_sacct_parsable(
                self._call(argv).stdout, local_tz=self._local_tz, nothing_read_is_error=False
            )
            _log_rejected(report.rejected)
            fallback = {other.job_id: other for other in reversed(report.jobs)}
        completed = []
        for _text_id, job in jobs:
            other = fallback.get(job.job_id)
            filled = fill_exit_codes(job, other) if job.exit_code is None and other else job
            if filled.std_paths_source is PathSource.UNKNOWN:
                filled = self._with_controller_paths(filled)
            completed.append(filled)
        return completed

    def queued_jobs(self) -> tuple[QueuedJob, ...]:
        """Every job slurmctld holds, with its owner and comment (one squeue call): where a
        live job is found by the token in its comment."""
        return parse_queue_json(self._call(list(QUEUE_JSON_ARGV)).stdout)

    def accounting_backlog(self) -> int:
        """How many messages slurmctld still holds for slurmdbd (sdiag's DBD Agent queue):
        while any are queued, a job that has ended may not be in accounting yet."""
        return parse_dbd_agent_queue(self._call(list(SDIAG_ARGV)).stdout)

    def _with_controller_paths(self, job: SlurmJob) -> SlurmJob:
        """22.05 accounting does not store std paths; slurmctld has them until MinJobAge."""
        try:
            result = self._call(show_job_argv(str(job.job_id)))
        except SlurmCommandError as error:
            if _UNKNOWN_JOB.search(error.stderr):
                return job
            raise
        known = parse_show_job(result.stdout)
        return replace(
            job,
            stdout_path=known.stdout_path,
            stderr_path=known.stderr_path,
            batch_host=job.batch_host or known.batch_host,
            restart_count=max(job.restart_count, known.restart_count),
            std_paths_source=PathSource.CONTROLLER,
        )

    def submit(
        self,
        script: str,
        *,
        as_user: str,
        comment: str | None = None,
        exclude_nodes: Iterable[str] = (),
        extra_args: Sequence[str] = (),
        work_dir: str | None = None,
    ) -> int:
        """Submit `script` (via stdin) as `as_user`; the job id, or SubmissionError.

        sbatch runs with `submission_environment` (the owner's, built on purpose), never this
        process's: whatever the daemon holds (its database URL among it) stays out of the job.
        """
        owner = self._owner(as_user)
        uid, gid = self._identity_for(owner)
        environment = submission_environment(
            owner, self._env if self._env is not None else os.environ
        )
        try:
            script.encode()
        except UnicodeEncodeError as error:
            raise SubmissionError(
                f"the script is not UTF-8 text ({error.reason} at {error.start})",
                argv=["sbatch"],
                returncode=None,
                stderr="",
            ) from error
        try:
            argv = sbatch_argv(
                SubmitRequest(
                    comment=comment,
                    exclude_nodes=tuple(exclude_nodes),
                    uid=uid,
                    gid=gid,
                    work_dir=work_dir,
                    extra_args=tuple(extra_args),
                )
            )
        except ValueError as error:
            raise SubmissionError(
                str(error), argv=["sbatch"], returncode=None, stderr=""
            ) from error
        try:
            result = self._runner(argv, timeout=self._timeout_s, input_text=script, env=environment)
        except CommandTimeout as error:
            raise SubmissionError(
                "sbatch timed out; the job may exist",
                argv=argv,
                returncode=None,
                stderr=error.stderr,
                maybe_submitted=True,
            ) from error
        except CommandError as error:
            raise SubmissionError(
                "sbatch could not run", argv=argv, returncode=None, stderr=str(error)
            ) from error
        if not result.ok:
            raise SubmissionError(
                "sbatch refused the job",
                argv=argv,
                returncode=result.returncode,
                stderr=result.stderr,
            )
        try:
            job_id, _cluster = parse_sbatch_parsable(result.stdout)
        except SlurmParseError as error:
            raise SubmissionError(
                f"sbatch answered without a job id ({error})",
                argv=argv,
                returncode=result.returncode,
                stderr=result.stderr,
                maybe_submitted=True,
            ) from error
        return job_id

    @staticmethod
    def _owner(user: str) -> pwd.struct_passwd:
        try:
            return pwd.getpwnam(user)
        except KeyError as error:
            raise SubmissionError(
                f"no such user {user!r}", argv=["sbatch"], returncode=None, stderr=""
            ) from error

    def _identity_for(self, entry: pwd.struct_passwd) -> tuple[int | None, int | None]:
        """As root: the owner's uid/gid for sbatch. Otherwise only the caller may be named."""
        if self._euid not in (0, entry.pw_uid):
            raise SubmissionError(
                f"cannot submit as {entry.pw_name!r} without root",
                argv=["sbatch"],
                returncode=None,
                stderr="",
            )
        return submitter_ids(entry, self._euid)

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        """Cancel the job, or with `signal` only send it (scancel's own meaning)."""
        self._call(scancel_argv(job_id, signal))

    # -- nodes ------------------------------------------------------------------------------

    def node(self, name: str) -> SlurmNode:
        try:
            result = self._call(show_node_argv(name))
        except SlurmCommandError as error:
            if _UNKNOWN_NODE.search(error.stderr) or _UNKNOWN_NODE.search(error.stdout):
                raise NodeNotFound(f"slurmctld does not know node {name!r}") from error
            raise
        found = parse_show_nodes(result.stdout, local_tz=self._local_tz).nodes
        if len(found) != 1 or found[0].name != name:
            raise NodeNotFound(f"slurmctld does not know node {name!r}")
        return found[0]

    def nodes(self) -> tuple[SlurmNode, ...]:
        report = parse_show_nodes(self._call(show_node_argv()).stdout, local_tz=self._local_tz)
        _log_rejected(report.rejected)
        return report.nodes

    def drain(self, node: str, reason: str) -> None:
        """Drain with a `medic:` reason; never overwrite a drain someone else set."""
        validate_reason(reason)
        current = self.node(node)
        if current.is_drained and not (current.reason or "").startswith(MEDIC_REASON_PREFIX):
            raise OperationRefused(
                f"{node} is already drained by {current.reason_user or 'someone'}: "
                f"{current.reason!r}; slurm-medic does not overwrite it"
            )
        self._call(drain_argv(node, reason))

    def resume(self, node: str) -> None:
        """Resume only a node whose current reason slurm-medic wrote."""
        current = self.node(node)
        if not (current.reason or "").startswith(MEDIC_REASON_PREFIX):
            raise OperationRefused(
                f"{node}'s reason {current.reason!r} was not set by slurm-medic; not resuming it"
            )
        self._call(resume_argv(node))

    # -- plumbing ---------------------------------------------------------------------------

    def _sacct(self, build: Callable[[bool], list[str]]) -> SacctReport:
        """`--json` where the release has it, else the `--parsable2` fallback (remembered).

        Unreadable records are logged and given to the caller, never an error on their own
        (even when no record could be read): the caller says what an absent job means."""
        if self._json:
            try:
                report = parse_sacct_json(
                    self._call(build(True)).stdout, nothing_read_is_error=False
                )
            except SlurmCommandError as error:
                if not _NO_JSON.search(error.stderr):
                    raise
                self._json = False
            else:
                _log_rejected(report.rejected)
                return report
        report = parse_sacct_parsable(
            self._call(build(False)).stdout, local_tz=self._local_tz, nothing_read_is_error=False
        )
        _log_rejected(report.rejected)
        return report

    def _call(self, argv: list[str]) -> CommandResult:
        """Run a read or an idempotent update, retrying while the controller does not answer."""
        last_error = ""
        for attempt in range(1, self._attempts + 1):
            try:
                result = self._runner(argv, timeout=self._timeout_s, env=self._env)
            except CommandTimeout:
                last_error = f"no answer within {self._timeout_s:g}s"
            except CommandError as error:
                raise SlurmCommandError(
                    "could not run", argv=argv, returncode=None, stderr=str(error)
                ) from error
            else:
                if result.ok:
                    return result
                if not _UNAVAILABLE.search(result.stderr):
                    raise SlurmCommandError(
                        "Slurm command failed",
                        argv=argv,
                        returncode=result.returncode,
                        stderr=result.stderr,
                        stdout=result.stdout,
                    )
                last_error = result.stderr.strip().splitlines()[-1]
            if attempt < self._attempts:
                self._sleep(self._backoff_s * 2 ** (attempt - 1))
        raise SlurmUnavailable(
            "Slurm did not answer", argv=argv, attempts=self._attempts, last_error=last_error
        )


def _asked_for(report: SacctReport, text_ids: Sequence[str]) -> list[tuple[str, SlurmJob]]:
    """The first job of the answer each id names (its own id, or `123_4` / `123+1`)."""
    by_id: dict[str, SlurmJob] = {}
    for job in report.jobs:
        by_id.setdefault(str(job.job_id), job)
        by_id.setdefault(job.display_id, job)
    return [(text_id, by_id[text_id]) for text_id in text_ids if text_id in by_id]


def _log_rejected(rejected: Iterable[RejectedRecord]) -> None:
    """Records a parser could not read are left out of the answer; each is said here."""
    for record in rejected:
        log.warning(
            "left out a record of %s (%s): %s; near %r",
            record.source,
            record.record_id or "no id",
            record.reason,
            record.excerpt,
        )
