"""sacct: argv builders and parsers for the JSON of several releases and the --parsable2 fallback.

Pure functions only: the backend joins them with the subprocess seam. JSON shapes differ by
release, so the parser reads `meta` first and picks the dialect from it:
`openapi/dbv0.0.38` (22.05) or `data_parser/v0.0.40`+ (23.11 and later).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, tzinfo
from enum import StrEnum
from typing import Any

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist
from daemon.slurm.paths import PathContext, expand_std_path
from daemon.slurm.records import JobState, PathSource, SlurmJob, SlurmStep

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
    return ["sacct", *_output_options(json_output), "--jobs", validate_job_id(job_id)]


_JOB_ID = re.compile(r"^[0-9]+(?:[_+][0-9]+)?$")


def validate_job_id(job_id: int | str) -> str:
    """Job ids reach argv; only `123`, `123_4` or `123+1` may pass, never an option."""
    text = str(job_id)
    if isinstance(job_id, bool) or not _JOB_ID.match(text):
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
# JSON


def parse_sacct_json(text: str) -> SacctReport:
    """Read `sacct --json` of any supported release into typed jobs (steps nested)."""
    if len(text) > MAX_JSON_BYTES:
        raise SlurmParseError(
            f"{len(text)} characters is more than the {MAX_JSON_BYTES} accepted",
            source="sacct --json",
        )
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise SlurmParseError(
            f"invalid JSON at line {error.lineno} column {error.colno}: {error.msg}",
            source="sacct --json",
            excerpt=text[max(0, error.pos - 40) : error.pos + 40],
        ) from error
    document = _mapping(document, "document")
    dialect, release = detect_dialect(document)
    _raise_reported_errors(document)
    raw_jobs = document.get("jobs")
    if not isinstance(raw_jobs, list):
        raise SlurmParseError("no `jobs` list", source=f"sacct --json ({dialect})")
    jobs = []
    for index, raw in enumerate(raw_jobs):
        try:
            jobs.append(_parse_json_job(_mapping(raw, "job"), dialect))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise SlurmParseError(
                f"job #{index}: {type(error).__name__}: {error}",
                source=f"sacct --json ({dialect})",
                excerpt=json.dumps(raw)[:200] if _is_jsonable(raw) else "",
            ) from error
    return SacctReport(jobs=tuple(jobs), dialect=dialect, slurm_release=release)


def detect_dialect(document: Mapping[str, Any]) -> tuple[JsonDialect, str | None]:
    """Pick the dialect from `meta.plugin` (keyed on meta, never guessed from the jobs)."""
    meta = document.get("meta")
    if not isinstance(meta, dict):
        raise SlurmParseError("no `meta` object to tell the release", source="sacct --json")
    plugin = meta.get("plugin")
    if not isinstance(plugin, dict):
        plugin = {}
    slurm = meta.get("slurm") or meta.get("Slurm") or {}
    release = str(slurm["release"]) if isinstance(slurm, dict) and slurm.get("release") else None
    names = [str(plugin.get(key) or "") for key in ("data_parser", "type")]
    for name in names:
        found = re.search(r"v0\.0\.(\d+)", name)
        if not found:
            continue
        minor = int(found.group(1))
        if "dbv0.0." in name and minor <= 39:
            return JsonDialect.DBV0_0_38, release
        if minor == 40:
            return JsonDialect.V0_0_40, release
        if minor == 41:
            return JsonDialect.V0_0_41, release
        if minor >= 42:
            # Later parsers keep v0.0.42's job shape so far; read them the same way.
            return JsonDialect.V0_0_42, release
    raise SlurmParseError(
        f"unknown plugin in meta: {plugin!r}", source="sacct --json", excerpt=str(meta)
    )


# slurmdb's "Nothing found with query": an empty answer, not a failure.
_NOTHING_FOUND = 9003


def _raise_reported_errors(document: Mapping[str, Any]) -> None:
    errors = document.get("errors") or []
    if not isinstance(errors, list):
        return
    errors = [
        error
        for error in errors
        if not (isinstance(error, dict) and error.get("error_number") == _NOTHING_FOUND)
    ]
    if not errors:
        return
    texts = []
    for error in errors:
        if isinstance(error, dict):
            texts.append(
                str(error.get("description") or error.get("error") or error.get("error_number"))
            )
        else:
            texts.append(str(error))
    raise SlurmParseError("sacct reported errors: " + "; ".join(texts), source="sacct --json")


def _parse_json_job(raw: Mapping[str, Any], dialect: JsonDialect) -> SlurmJob:
    state_raw = _state_text(raw.get("state"))
    state = JobState.parse(state_raw)
    exit_code, exit_signal = _exit(raw.get("exit_code"), dialect, state)
    derived_code, derived_signal = _exit(raw.get("derived_exit_code"), dialect, None)
    times = raw.get("time") or {}
    array = raw.get("array") or {}
    het = raw.get("het") or {}
    comment = raw.get("comment")
    steps = tuple(
        _parse_json_step(_mapping(step, "step"), dialect) for step in raw.get("steps") or []
    )
    array_job_id = _optional_int(array.get("job_id")) or None
    array_task_id = _optional_int(array.get("task_id")) if array_job_id else None
    het_job_id = _optional_int(het.get("job_id")) or None
    name = str(raw.get("name") or "")
    user = str(raw.get("user") or "")
    work_dir = _optional_str(raw.get("working_directory"))
    context = PathContext(
        job_id=int(raw["job_id"]),
        name=name,
        user=user,
        first_node=_batch_host(steps),
        array_job_id=array_job_id,
        array_task_id=array_task_id,
    )
    stdout, stderr, source = _std_paths(raw, dialect, context, work_dir)
    return SlurmJob(
        job_id=context.job_id,
        name=name,
        user=user,
        uid=_optional_int(raw.get("uid")),
        group=_optional_str(raw.get("group")),
        account=_optional_str(raw.get("account")),
        partition=_optional_str(raw.get("partition")),
        state=state,
        state_raw=state_raw,
        exit_code=exit_code,
        exit_signal=exit_signal,
        derived_exit_code=derived_code,
        derived_exit_signal=derived_signal,
        nodes=expand_hostlist(_optional_str(raw.get("nodes"))),
        batch_host=_batch_host(steps),
        submit_time=_epoch(times.get("submission")),
        start_time=_epoch(times.get("start")),
        end_time=_epoch(times.get("end")),
        stdout_path=stdout,
        stderr_path=stderr,
        work_dir=work_dir,
        comment=_optional_str(comment.get("job")) if isinstance(comment, dict) else None,
        restart_count=_optional_int(raw.get("restart_cnt")) or 0,
        array_job_id=array_job_id,
        array_task_id=array_task_id,
        het_job_id=het_job_id,
        het_job_offset=_optional_int(het.get("job_offset")) if het_job_id else None,
        steps=steps,
        std_paths_source=source,
        cluster=_optional_str(raw.get("cluster")),
        killed_by=_optional_str(raw.get("kill_request_user")),
        accounting_complete=_optional_str(raw.get("partition")) is not None,
    )


def _std_paths(
    raw: Mapping[str, Any], dialect: JsonDialect, context: PathContext, work_dir: str | None
) -> tuple[str | None, str | None, PathSource]:
    """Expanded paths from v0.0.41+; v0.0.40's patterns expanded here; 22.05 stores none."""
    if dialect is JsonDialect.DBV0_0_38:
        return None, None, PathSource.UNKNOWN
    stdout = _optional_str(raw.get("stdout_expanded"))
    stderr = _optional_str(raw.get("stderr_expanded"))
    if stdout or stderr:
        return stdout, stderr or stdout, PathSource.ACCOUNTING
    stdout = _optional_str(raw.get("stdout"))
    stderr = _optional_str(raw.get("stderr")) or stdout
    if stdout is None and stderr is None:
        return None, None, PathSource.UNKNOWN
    return (
        expand_std_path(stdout, context, work_dir=work_dir) if stdout else None,
        expand_std_path(stderr, context, work_dir=work_dir) if stderr else None,
        PathSource.ACCOUNTING_PATTERN,
    )


def _parse_json_step(raw: Mapping[str, Any], dialect: JsonDialect) -> SlurmStep:
    step = raw.get("step") or {}
    step_id = step.get("id")
    state_raw = _state_text(raw.get("state"))
    state = JobState.parse(state_raw)
    exit_code, exit_signal = _exit(raw.get("exit_code"), dialect, state)
    times = raw.get("time") or {}
    nodes = raw.get("nodes") or {}
    return SlurmStep(
        step_id=_step_suffix(str(step_id if step_id is not None else "")),
        name=str(step.get("name") or ""),
        state=state,
        state_raw=state_raw,
        exit_code=exit_code,
        exit_signal=exit_signal,
        nodes=expand_hostlist(_optional_str(nodes.get("range"))),
        start_time=_epoch(times.get("start")),
        end_time=_epoch(times.get("end")),
    )


def _step_suffix(step_id: str) -> str:
    """`123.batch` and `batch` both name the step `batch`; `123.0` is step `0`."""
    return step_id.rsplit(".", 1)[-1] if "." in step_id else step_id


def _batch_host(steps: Sequence[SlurmStep]) -> str | None:
    for step in steps:
        if step.step_id == "batch" and step.nodes:
            return step.nodes[0]
    return None


def _state_text(value: Any) -> str:
    """`"FAILED"`, `["FAILED"]` or `{"current": ...}` (by release) as one text."""
    if isinstance(value, dict):
        value = value.get("current")
    if isinstance(value, list):
        return "+".join(str(part) for part in value) if value else "UNKNOWN"
    if value is None:
        return "UNKNOWN"
    return str(value)


def _exit(
    value: Any, dialect: JsonDialect, state: JobState | None
) -> tuple[int | None, int | None]:
    """Exit code and signal from either release's `exit_code` object; None where unknown.

    22.05's dbv0.0.38 prints `SUCCESS`/0 for every exit that was not a signal (a job that
    exited 1 reads as SUCCESS; seen in tests/data/slurm/dbv0.0.38). There a SUCCESS is
    believed only for a record whose own state is COMPLETED; `state=None` (the derived exit
    code) never believes it. Signals are reported correctly and kept.
    """
    if not isinstance(value, dict):
        return None, None
    statuses = value.get("status")
    status_text = " ".join(statuses) if isinstance(statuses, list) else str(statuses or "")
    signal_obj = value.get("signal") or {}
    signal = None
    if isinstance(signal_obj, dict):
        signal = _optional_int(signal_obj.get("id", signal_obj.get("signal_id")))
    if "SIGNALED" in status_text:
        return _optional_int(value.get("return_code")), signal
    code = _optional_int(value.get("return_code"))
    untrusted_success = dialect is JsonDialect.DBV0_0_38 and status_text == "SUCCESS"
    if untrusted_success and state is not JobState.COMPLETED:
        return None, None
    return code, ((signal or 0) if code is not None else signal)


def _optional_int(value: Any) -> int | None:
    """A plain int, or the no-value struct `{set, infinite, number}` of v0.0.40+."""
    if isinstance(value, dict):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise TypeError(f"expected an integer, got {value!r}")


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text if text else None


def _epoch(value: Any) -> datetime | None:
    seconds = _optional_int(value)
    if not seconds:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SlurmParseError(f"{what} is {type(value).__name__}, not an object", source="sacct")
    return value


def _is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# --parsable2 fallback


def parse_sacct_parsable(text: str, *, local_tz: tzinfo | None = None) -> SacctReport:
    """Read `sacct --parsable2 --delimiter=\\x1f --format=PARSABLE_FIELDS` (22.05 or older).

    A name or comment with a newline splits a row across lines; rows are joined back until
    they hold every field. Steps (`123.batch`) are nested into their job.
    """
    try:
        return _parse_parsable_rows(_parsable_rows(text), local_tz)
    except (TypeError, ValueError) as error:
        raise SlurmParseError(str(error), source="sacct --parsable2") from error


def _parse_parsable_rows(rows: list[dict[str, str]], local_tz: tzinfo | None) -> SacctReport:
    jobs: dict[str, dict[str, str]] = {}
    steps: dict[str, list[SlurmStep]] = {}
    order: list[str] = []
    for row in rows:
        raw_id = row["JobIDRaw"]
        job_part, _, step_part = raw_id.partition(".")
        if step_part:
            steps.setdefault(job_part, []).append(_parsable_step(row, step_part, local_tz))
        else:
            jobs[job_part] = row
            order.append(job_part)
    parsed = tuple(_parsable_job(jobs[key], tuple(steps.get(key, ())), local_tz) for key in order)
    return SacctReport(jobs=parsed, dialect=None, slurm_release=None)


def _parsable_rows(text: str) -> list[dict[str, str]]:
    """Rows of `width` fields; a newline inside a value continues the row it belongs to.

    A line with no delimiter after a complete row continues its last field (the comment);
    a row short of fields takes the next line (a name with a newline).
    """
    width = len(PARSABLE_FIELDS)
    rows: list[dict[str, str]] = []
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


def _parsable_row(text: str, width: int) -> dict[str, str]:
    values = text.split(PARSABLE_DELIMITER)
    if len(values) < width:
        raise SlurmParseError(
            f"output ends inside a row (truncated?): {len(values)} of {width} fields",
            source="sacct --parsable2",
            excerpt=text,
        )
    if len(values) > width:
        raise SlurmParseError(
            f"row has {len(values)} fields, expected {width}",
            source="sacct --parsable2",
            excerpt=text,
        )
    return dict(zip(PARSABLE_FIELDS, values, strict=True))


def _parsable_job(
    row: Mapping[str, str], steps: tuple[SlurmStep, ...], local_tz: tzinfo | None
) -> SlurmJob:
    exit_code, exit_signal = _colon_pair(row["ExitCode"])
    derived_code, derived_signal = _colon_pair(row["DerivedExitCode"])
    array_job_id, array_task_id, het_job_id, het_offset = _display_id_parts(row["JobID"])
    try:
        job_id = int(row["JobIDRaw"])
    except ValueError as error:
        raise SlurmParseError(
            "JobIDRaw is not a number", source="sacct --parsable2", excerpt=row["JobIDRaw"]
        ) from error
    state_raw = row["State"]
    return SlurmJob(
        job_id=job_id,
        name=row["JobName"],
        user=row["User"],
        uid=_optional_int(row["UID"] or None),
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
        batch_host=_batch_host(steps),
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


_DISPLAY_ID = re.compile(r"^(\d+)(?:_(\d+)|\+(\d+))?(?:\..*)?$")


def _display_id_parts(text: str) -> tuple[int | None, int | None, int | None, int | None]:
    """`123_4` is array 123 task 4; `123+1` is het job 123 component 1; else none."""
    match = _DISPLAY_ID.match(text)
    if not match:
        return None, None, None, None
    base = int(match.group(1))
    if match.group(2) is not None:
        return base, int(match.group(2)), None, None
    if match.group(3) is not None:
        return None, None, base, int(match.group(3))
    return None, None, None, None


def _colon_pair(text: str) -> tuple[int | None, int | None]:
    code, _, signal = text.partition(":")
    try:
        return (int(code) if code else None), (int(signal) if signal else None)
    except ValueError as error:
        raise SlurmParseError(
            "exit code is not N:M", source="sacct --parsable2", excerpt=text
        ) from error


_CANCELLED_BY = re.compile(r"^CANCELLED by (\S+)")


def _cancelled_by(state_raw: str) -> str | None:
    match = _CANCELLED_BY.match(state_raw)
    return match.group(1) if match else None


def _local_time(text: str, local_tz: tzinfo | None) -> datetime | None:
    if not text or text in {"Unknown", "None", "N/A"}:
        return None
    try:
        naive = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError as error:
        raise SlurmParseError(
            "time is not YYYY-MM-DDTHH:MM:SS", source="sacct --parsable2", excerpt=text
        ) from error
    zone = local_tz or datetime.now().astimezone().tzinfo
    return naive.replace(tzinfo=zone).astimezone(UTC)


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
