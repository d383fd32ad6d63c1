"""sacct's --parsable2 output, the fallback where JSON is missing or lacks a figure (22.05 and
older print no exit codes in JSON): rows joined back where a value held a newline, steps
nested into their job.

Apart from the JSON parser (`sacct_json`) because its input is delimited text whose rows can
break, read in the cluster's local time zone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, tzinfo

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist
from daemon.slurm.records import (
    MAX_EPOCH_SECONDS,
    MAX_EXIT_CODE,
    MAX_JOB_ID,
    MAX_SIGNAL,
    MAX_UID,
    MIN_EXIT_CODE,
    JobState,
    PathSource,
    RejectedRecord,
    SlurmJob,
    SlurmStep,
)
from daemon.slurm.sacct import (
    INTEGER_PATTERN,
    MAX_JSON_BYTES,
    PARSABLE_DELIMITER,
    PARSABLE_FIELDS,
    SacctReport,
    batch_host_of,
    bounded_number,
    error_detail,
    job_number,
    raise_if_nothing_read,
)


@dataclass(frozen=True)
class _Row:
    """One row of --parsable2: its fields, or why it could not be cut into them."""

    fields: Mapping[str, str] | None
    text: str
    job_key: str | None  # the job id the row belongs to (`123` of `123.batch`), if readable
    is_step: bool
    error: SlurmParseError | None = None


def parse_sacct_parsable(
    text: str, *, local_tz: tzinfo | None = None, nothing_read_is_error: bool = True
) -> SacctReport:
    """Read `sacct --parsable2 --delimiter=\\x1f --format=PARSABLE_FIELDS` (22.05 or older).

    A name or comment with a newline splits a row across lines; rows are joined back until
    they hold every field. Steps (`123.batch`) are nested into their job. A job whose row
    or any of whose step rows cannot be read is rejected alone, as in `parse_sacct_json`
    (whose `nothing_read_is_error` this takes too).
    """
    if len(text) > MAX_JSON_BYTES:
        raise SlurmParseError(
            f"{len(text)} characters is more than the {MAX_JSON_BYTES} accepted",
            source=_PARSABLE,
        )
    order: list[str] = []
    groups: dict[str, list[_Row]] = {}
    rejected: list[RejectedRecord] = []
    for row in _parsable_rows(text):
        if row.job_key is None:
            assert row.error is not None
            rejected.append(RejectedRecord.of(row.error, raw=row.text))
            continue
        if not row.is_step:
            order.append(row.job_key)
        groups.setdefault(row.job_key, []).append(row)
    jobs: list[SlurmJob] = []
    for key in dict.fromkeys(order):
        try:
            jobs.append(_parsable_group(groups[key], local_tz))
        except SlurmParseError as error:
            excerpt = next((row.text for row in groups[key] if row.error), groups[key][0].text)
            reason = SlurmParseError(
                f"job {key}: {error_detail(error)}", source=_PARSABLE, excerpt=excerpt
            )
            raw = "\n".join(row.text for row in groups[key])
            rejected.append(RejectedRecord.of(reason, key, raw))
    if nothing_read_is_error:
        raise_if_nothing_read(jobs, rejected, _PARSABLE)
    return SacctReport(jobs=tuple(jobs), dialect=None, slurm_release=None, rejected=tuple(rejected))


_PARSABLE = "sacct --parsable2"
_JOB_KEY = re.compile(r"[0-9]{1,10}")


def _parsable_group(rows: Sequence[_Row], local_tz: tzinfo | None) -> SlurmJob:
    """A job row and its step rows, all readable, as one job."""
    for row in rows:
        if row.error is not None:
            raise row.error
    job_rows = [row.fields for row in rows if row.fields is not None and not row.is_step]
    if len(job_rows) != 1:
        raise SlurmParseError(f"{len(job_rows)} rows for one job id", source=_PARSABLE)
    steps = tuple(
        _parsable_step(row.fields, row.fields["JobIDRaw"].partition(".")[2], local_tz)
        for row in rows
        if row.fields is not None and row.is_step
    )
    return _parsable_job(job_rows[0], steps, local_tz)


def _parsable_rows(text: str) -> list[_Row]:
    """Rows of `width` fields; a newline inside a value continues the row it belongs to.

    A line with no delimiter after a complete row continues its last field (the comment);
    a row short of fields takes the next line (a name with a newline).
    """
    width = len(PARSABLE_FIELDS)
    rows: list[_Row] = []
    pending: str | None = None
    body = text[:-1] if text.endswith("\n") else text
    for line in body.split("\n") if body else []:
        if pending is None:
            pending = line
            continue
        count = pending.count(PARSABLE_DELIMITER) + 1
        if count < width or PARSABLE_DELIMITER not in line:
            pending = f"{pending}\n{line}"
            continue
        rows.append(_parsable_row(pending, width))
        pending = line
    if pending is not None:
        rows.append(_parsable_row(pending, width))
    return rows


def _parsable_row(text: str, width: int) -> _Row:
    values = text.split(PARSABLE_DELIMITER)
    # JobIDRaw is the second field: it names the row's job even when the row is broken.
    raw_id = values[1] if len(values) > 1 else ""
    key, dot, _ = raw_id.partition(".")
    job_key = key if _JOB_KEY.fullmatch(key) else None
    is_step = bool(dot)
    if len(values) != width:
        problem = (
            f"output ends inside a row (truncated?): {len(values)} of {width} fields"
            if len(values) < width
            else f"row has {len(values)} fields, expected {width}"
        )
        error = SlurmParseError(problem, source=_PARSABLE, excerpt=text)
        return _Row(None, text, job_key, is_step, error)
    if job_key is None:
        error = SlurmParseError("JobIDRaw is not a number", source=_PARSABLE, excerpt=raw_id)
        return _Row(None, text, None, is_step, error)
    return _Row(dict(zip(PARSABLE_FIELDS, values, strict=True)), text, job_key, is_step)


def _parsable_job(
    row: Mapping[str, str], steps: tuple[SlurmStep, ...], local_tz: tzinfo | None
) -> SlurmJob:
    exit_code, exit_signal = _colon_pair(row["ExitCode"])
    derived_code, derived_signal = _colon_pair(row["DerivedExitCode"])
    array_job_id, array_task_id, het_job_id, het_offset = _display_id_parts(row["JobID"])
    job_id = bounded_number(row["JobIDRaw"], "JobIDRaw", 1, MAX_JOB_ID)
    if job_id is None:
        raise SlurmParseError("JobIDRaw is not a number", source=_PARSABLE, excerpt=row["JobIDRaw"])
    state_raw = row["State"]
    return SlurmJob(
        job_id=job_id,
        name=row["JobName"],
        user=row["User"],
        uid=bounded_number(row["UID"] or None, "UID", 0, MAX_UID),
        group=row["Group"] or None,
        account=row["Account"] or None,
        partition=row["Partition"] or None,
        state=JobState.parse(state_raw),
        state_raw=state_raw,
        exit_code=exit_code,
        exit_signal=exit_signal,
        derived_exit_code=derived_code,
        derived_exit_signal=derived_signal,
        nodes=expand_hostlist(row["NodeList"]),
        batch_host=batch_host_of(steps),
        submit_time=_local_time(row["Submit"], local_tz),
        start_time=_local_time(row["Start"], local_tz),
        end_time=_local_time(row["End"], local_tz),
        stdout_path=None,
        stderr_path=None,
        work_dir=row["WorkDir"] or None,
        comment=row["Comment"] or None,
        array_job_id=array_job_id,
        array_task_id=array_task_id,
        het_job_id=het_job_id,
        het_job_offset=het_offset,
        steps=steps,
        std_paths_source=PathSource.UNKNOWN,
        killed_by=_cancelled_by(state_raw),
        accounting_complete=bool(row["Partition"]),
    )


def _parsable_step(row: Mapping[str, str], step_id: str, local_tz: tzinfo | None) -> SlurmStep:
    exit_code, exit_signal = _colon_pair(row["ExitCode"])
    return SlurmStep(
        step_id=step_id,
        name=row["JobName"],
        state=JobState.parse(row["State"]),
        state_raw=row["State"],
        exit_code=exit_code,
        exit_signal=exit_signal,
        nodes=expand_hostlist(row["NodeList"]),
        start_time=_local_time(row["Start"], local_tz),
        end_time=_local_time(row["End"], local_tz),
    )


_DISPLAY_ID = re.compile(r"([0-9]{1,10})(?:_([0-9]{1,10})|\+([0-9]{1,10}))?(?:\..*)?\Z")


def _display_id_parts(text: str) -> tuple[int | None, int | None, int | None, int | None]:
    """`123_4` is array 123 task 4; `123+1` is het job 123 component 1; else none."""
    match = _DISPLAY_ID.match(text)
    if not match:
        return None, None, None, None
    base = job_number(match.group(1), "JobID")
    if match.group(2) is not None:
        return base, job_number(match.group(2), "JobID"), None, None
    if match.group(3) is not None:
        return None, None, base, job_number(match.group(3), "JobID")
    return None, None, None, None


def _colon_pair(text: str) -> tuple[int | None, int | None]:
    """`1:0` (exit code, signal); either side may be empty."""
    code, _, signal = text.partition(":")
    if not all(part == "" or INTEGER_PATTERN.fullmatch(part) for part in (code, signal)):
        raise SlurmParseError("exit code is not N:M", source=_PARSABLE, excerpt=text)
    return (
        bounded_number(code or None, "exit code", MIN_EXIT_CODE, MAX_EXIT_CODE),
        bounded_number(signal or None, "exit signal", 0, MAX_SIGNAL),
    )


_CANCELLED_BY = re.compile(r"CANCELLED by (\S+)")
_LOCAL_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}")


def _cancelled_by(state_raw: str) -> str | None:
    match = _CANCELLED_BY.match(state_raw)
    return match.group(1) if match else None


def _local_time(text: str, local_tz: tzinfo | None) -> datetime | None:
    if not text or text in {"Unknown", "None", "N/A"}:
        return None
    moment = local_time(text, local_tz)
    if moment is None:
        raise SlurmParseError(
            "time is not YYYY-MM-DDTHH:MM:SS from 1970 on", source=_PARSABLE, excerpt=text
        )
    return moment


def local_time(text: str, local_tz: tzinfo | None) -> datetime | None:
    """`2026-11-22T03:12:58` in the cluster's zone (this machine's if None) as UTC; None for
    anything else: non-ASCII digits, and times before 1970 or that no record can hold."""
    if not _LOCAL_TIME.fullmatch(text):
        return None
    try:
        naive = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
        zone = local_tz or datetime.now().astimezone().tzinfo
        moment = naive.replace(tzinfo=zone).astimezone(UTC)
    except (ValueError, OverflowError):
        return None
    return moment if 0 <= moment.timestamp() <= MAX_EPOCH_SECONDS else None


def fill_exit_codes(job: SlurmJob, fallback: SlurmJob) -> SlurmJob:
    """Take exit codes that `job` (22.05 JSON) lacks from the same job read via --parsable2."""
    steps_by_id = {step.step_id: step for step in fallback.steps}
    steps = tuple(
        replace(step, exit_code=other.exit_code, exit_signal=other.exit_signal)
        if step.exit_code is None and (other := steps_by_id.get(step.step_id)) is not None
        else step
        for step in job.steps
    )
    exit_code, exit_signal = job.exit_code, job.exit_signal
    if exit_code is None:
        exit_code, exit_signal = fallback.exit_code, fallback.exit_signal
    derived_code, derived_signal = job.derived_exit_code, job.derived_exit_signal
    if derived_code is None:
        derived_code, derived_signal = fallback.derived_exit_code, fallback.derived_exit_signal
    return replace(
        job,
        exit_code=exit_code,
        exit_signal=exit_signal,
        derived_exit_code=derived_code,
        derived_exit_signal=derived_signal,
        steps=steps,
    )
