"""sacct: argv builders, and what its two parsers share (the report they return, the number
readers and the reject rules).

Pure functions only: the backend joins them with the subprocess seam. The JSON parser of
several releases is `sacct_json`, the --parsable2 fallback `sacct_parsable`; what both need
lives here so that neither imports the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from enum import StrEnum
from typing import Any

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import (
    MAX_JOB_ID,
    JobState,
    RejectedRecord,
    SlurmJob,
    SlurmStep,
)

# Largest sacct JSON accepted before parsing: a bound against a runaway window, not a limit
# any sane poll reaches (about 6 KB per job).
MAX_JSON_BYTES = 512 * 1024 * 1024

# A field separator that no job name or comment sensibly contains (ASCII unit separator).
PARSABLE_DELIMITER = "\x1f"

PARSABLE_FIELDS: tuple[str, ...] = (
    "JobID",
    "JobIDRaw",
    "User",
    "UID",
    "Group",
    "Account",
    "Partition",
    "State",
    "ExitCode",
    "DerivedExitCode",
    "NodeList",
    "Submit",
    "Start",
    "End",
    "WorkDir",
    "JobName",
    "Comment",
)


class JsonDialect(StrEnum):
    """The JSON shape a release prints; each names the plugin `meta` reports."""

    DBV0_0_38 = "dbv0.0.38"
    V0_0_40 = "v0.0.40"
    V0_0_41 = "v0.0.41"
    V0_0_42 = "v0.0.42"


@dataclass(frozen=True)
class SacctReport:
    """What one sacct call returned: the jobs, the dialect, and the Slurm release if given."""

    jobs: tuple[SlurmJob, ...]
    dialect: JsonDialect | None
    slurm_release: str | None
    # Records that could not be read, each with its reason and raw text: the jobs above are
    # every other record. A caller moving a cursor past this window knows what it skips.
    rejected: tuple[RejectedRecord, ...] = ()


def sacct_time(moment: datetime, local_tz: tzinfo | None = None) -> str:
    """sacct reads naive times in the machine's local zone; aware datetimes are converted."""
    if moment.tzinfo is None:
        raise ValueError("sacct times must be timezone-aware")
    return moment.astimezone(local_tz).strftime("%Y-%m-%dT%H:%M:%S")


def sacct_window_argv(
    *,
    since: datetime,
    until: datetime,
    states: Iterable[JobState] = (),
    users: Iterable[str] = (),
    json_output: bool = True,
    local_tz: tzinfo | None = None,
) -> list[str]:
    """One sacct call for every job (all users unless `users`) in `states` during the window.

    With `--state`, sacct selects jobs that were in one of those states between the two
    times, which for final states means "ended in the window".
    """
    if until < since:
        raise ValueError(f"window ends ({until}) before it starts ({since})")
    argv = ["sacct", *_output_options(json_output)]
    user_list = sorted(set(users))
    argv += ["--user", ",".join(user_list)] if user_list else ["--allusers"]
    argv += [
        "--starttime",
        sacct_time(since, local_tz),
        "--endtime",
        sacct_time(until, local_tz),
    ]
    state_list = sorted({JobState(state).value for state in states})
    if state_list:
        argv += ["--state", ",".join(state_list)]
    return argv


def sacct_job_argv(job_id: int | str, *, json_output: bool = True) -> list[str]:
    """One job (with its steps and, for an array id, its tasks)."""
    return sacct_jobs_argv([job_id], json_output=json_output)


def sacct_jobs_argv(job_ids: Sequence[int | str], *, json_output: bool = True) -> list[str]:
    """Several jobs in one call (`--jobs 12,13,9_1`), each as `sacct_job_argv` would ask it."""
    if not job_ids:
        raise ValueError("no job ids to ask for")
    ids = ",".join(validate_job_id(job_id) for job_id in job_ids)
    return ["sacct", *_output_options(json_output), "--jobs", ids]


_JOB_ID = re.compile(r"[0-9]{1,10}(?:[_+][0-9]{1,10})?")


def validate_job_id(job_id: int | str) -> str:
    """Job ids reach argv; only `123`, `123_4` or `123+1` may pass, never an option."""
    text = str(job_id)
    if isinstance(job_id, bool) or not _JOB_ID.fullmatch(text):
        raise ValueError(f"not a Slurm job id: {text!r}")
    return text


def _output_options(json_output: bool) -> list[str]:
    if json_output:
        return ["--json"]
    return [
        "--parsable2",
        "--noheader",
        f"--delimiter={PARSABLE_DELIMITER}",
        "--format=" + ",".join(PARSABLE_FIELDS),
    ]


# ---------------------------------------------------------------------------------------------
# What both parsers share


def error_detail(error: SlurmParseError) -> str:
    """The reason, naming the part that raised it when that is not sacct's own reading."""
    return error.reason if error.source.startswith("sacct") else str(error)


def raise_if_nothing_read(
    jobs: Sequence[SlurmJob], rejected: Sequence[RejectedRecord], source: str
) -> None:
    """Output whose every record is unreadable is not a partial answer: it is an error."""
    if rejected and not jobs:
        first = rejected[0]
        raise SlurmParseError(
            f"no job could be read ({len(rejected)} rejected); the first: {first.reason}",
            source=source,
            excerpt=first.excerpt,
        )


def batch_host_of(steps: Sequence[SlurmStep]) -> str | None:
    """The node the batch step ran on: where the job's script, and so its logs, were."""
    for step in steps:
        if step.step_id == "batch" and step.nodes:
            return step.nodes[0]
    return None


# Digits read as a number: ASCII only (int() also takes "²"'s kin and "1_000"), and few enough
# that int() is cheap; the range check comes after.
INTEGER_PATTERN = re.compile(r"-?[0-9]{1,20}")


def bounded_number(value: Any, what: str, low: int, high: int) -> int | None:
    """A plain int, ASCII digits, or the no-value struct `{set, infinite, number}` of v0.0.40+,
    within `low..high`; None where Slurm says there is none."""
    if isinstance(value, dict):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str) and INTEGER_PATTERN.fullmatch(value.strip()):
        value = int(value.strip())
    if not isinstance(value, int):
        raise SlurmParseError(
            f"{what}: expected an integer, got {repr(value)[:40]}", source="sacct"
        )
    if not low <= value <= high:
        shown = str(value) if value.bit_length() <= 64 else f"a {value.bit_length()}-bit number"
        raise SlurmParseError(f"{what} {shown} is outside {low}..{high}", source="sacct")
    return value


def job_number(value: Any, what: str) -> int | None:
    """Job ids, array task ids and het offsets: Slurm's 32 unsigned bits."""
    return bounded_number(value, what, 0, MAX_JOB_ID)
