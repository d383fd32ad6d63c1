"""squeue: the argv and the parser of `squeue --json`, for the jobs slurmctld still holds.

Reconciliation looks for a job by the token in its comment: 22.05 accounting stores a comment
only once the job ends, so a live job is found in slurmctld's queue. JSON, not
`--format=%i|%k`: a comment may hold a newline, and with it a forged line.
"""

from __future__ import annotations

import json

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import JobState, QueuedJob

QUEUE_JSON_ARGV = ("squeue", "--json", "--all", "--states=all")


def parse_queue_json(text: str) -> tuple[QueuedJob, ...]:
    """`squeue --json` as jobs with owner and comment; array tasks and records without a
    plain job id or owner are skipped (a relaunch is never an array task). 22.05 prints
    plain numbers, 23.11+ may wrap them as `{"set": true, "number": N}`."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise SlurmParseError(f"not JSON: {error}", source="squeue --json") from error
    raw_jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(raw_jobs, list):
        raise SlurmParseError("no jobs list", source="squeue --json")
    jobs = []
    for raw in raw_jobs:
        if not isinstance(raw, dict):
            continue
        job_id = _json_number(raw.get("job_id"))
        user = raw.get("user_name")
        comment = raw.get("comment")
        if _json_number(raw.get("array_task_id")) is not None or job_id is None:
            continue
        if not isinstance(user, str) or not user:
            continue
        jobs.append(
            QueuedJob(
                job_id,
                user,
                comment if isinstance(comment, str) else "",
                _job_state(raw.get("job_state")),
            )
        )
    return tuple(jobs)


def _job_state(value: object) -> JobState:
    """22.05 prints `"FAILED"`, 23.11+ a list of the base state and its flags."""
    names = value if isinstance(value, list) else [value]
    for name in names:
        if isinstance(name, str):
            state = JobState.parse(name)
            if state is not JobState.UNKNOWN:
                return state
    return JobState.UNKNOWN


def _json_number(value: object) -> int | None:
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        return None
    return value
