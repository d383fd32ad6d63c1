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

from daemon.slurm.errors import EXCERPT_CHARS, SlurmParseError
from daemon.slurm.hostlist import expand_hostlist
from daemon.slurm.paths import MAX_PATH_CHARS, PathContext, expand_std_path
from daemon.slurm.records import (
    MAX_COUNT,
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
# JSON


def parse_sacct_json(text: str, *, nothing_read_is_error: bool = True) -> SacctReport:
    """Read `sacct --json` of any supported release into typed jobs (steps nested).

    A job that cannot be read (a step, a number or a hostlist in it) is rejected alone, with
    the reason and its text, and the others are read as if it were not there. SlurmParseError
    is the only error: for a document that is not sacct's, or (unless `nothing_read_is_error`
    is False, as for a poll that records what it rejects) one whose jobs are all unreadable.
    """
    if len(text) > MAX_JSON_BYTES:
        raise SlurmParseError(
            f"{len(text)} characters is more than the {MAX_JSON_BYTES} accepted",
            source="sacct --json",
        )
    document = _mapping(_load_json(text, "sacct --json"), "document")
    dialect, release = detect_dialect(document)
    _raise_reported_errors(document)
    raw_jobs = document.get("jobs")
    if not isinstance(raw_jobs, list):
        raise SlurmParseError("no `jobs` list", source=f"sacct --json ({dialect})")
    source = f"sacct --json ({dialect})"
    jobs: list[SlurmJob] = []
    rejected: list[RejectedRecord] = []
    for index, raw in enumerate(raw_jobs):
        try:
            jobs.append(_json_job(raw, dialect))
        except SlurmParseError as error:
            raw_text = _json_text(raw)
            reason = SlurmParseError(
                f"job #{index}: {_detail(error)}", source=source, excerpt=raw_text
            )
            rejected.append(RejectedRecord.of(reason, _json_job_id(raw), raw_text))
    if nothing_read_is_error:
        _raise_if_nothing_read(jobs, rejected, source)
    return SacctReport(
        jobs=tuple(jobs), dialect=dialect, slurm_release=release, rejected=tuple(rejected)
    )


def _load_json(text: str, source: str) -> Any:
    """json.loads with every way it fails as a SlurmParseError: bad syntax, an integer of
    more than 4300 digits (ValueError), nesting deeper than the interpreter's stack."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise SlurmParseError(
            f"invalid JSON at line {error.lineno} column {error.colno}: {error.msg}",
            source=source,
            excerpt=text[max(0, error.pos - 40) : error.pos + 40],
        ) from error
    except (ValueError, RecursionError) as error:
        raise SlurmParseError(f"unreadable JSON: {error}", source=source) from error


def _json_job(raw: Any, dialect: JsonDialect) -> SlurmJob:
    """One job; Python's own errors on a shape no release prints become the parse error."""
    try:
        return _parse_json_job(_mapping(raw, "job"), dialect)
    except (LookupError, TypeError, ValueError, ArithmeticError, AttributeError) as error:
        raise SlurmParseError(f"{type(error).__name__}: {error}", source="sacct") from error


def _detail(error: SlurmParseError) -> str:
    """The reason, naming the part that raised it when that is not sacct's own reading."""
    return error.reason if error.source.startswith("sacct") else str(error)


def _json_text(raw: Any) -> str:
    """A rejected job's own JSON, written again (the document's bytes are not kept apart)."""
    try:
        return json.dumps(raw)
    except (TypeError, ValueError, RecursionError):
        return ""


def _json_job_id(raw: Any) -> str | None:
    job_id = raw.get("job_id") if isinstance(raw, dict) else None
    if isinstance(job_id, int) and not isinstance(job_id, bool) and 0 < job_id <= MAX_JOB_ID:
        return str(job_id)
    return None


def _raise_if_nothing_read(
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


def detect_dialect(document: Mapping[str, Any]) -> tuple[JsonDialect, str | None]:
    """Pick the dialect from `meta.plugin` (keyed on meta, never guessed from the jobs)."""
    meta = document.get("meta")
    if not isinstance(meta, dict):
        raise SlurmParseError("no `meta` object to tell the release", source="sacct --json")
    plugin = meta.get("plugin")
    if not isinstance(plugin, dict):
        plugin = {}
    slurm = meta.get("slurm") or meta.get("Slurm") or {}
    release = (
        str(slurm["release"])[:_RELEASE_CHARS]
        if isinstance(slurm, dict) and slurm.get("release")
        else None
    )
    names = [str(plugin.get(key) or "")[:_RELEASE_CHARS] for key in ("data_parser", "type")]
    for name in names:
        found = _PLUGIN_VERSION.search(name)
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
        f"unknown plugin in meta: {repr(plugin)[:EXCERPT_CHARS]}",
        source="sacct --json",
        excerpt=repr(meta)[:EXCERPT_CHARS],
    )


_PLUGIN_VERSION = re.compile(r"v0\.0\.([0-9]{1,4})")
_RELEASE_CHARS = 64
# slurmdb's "Nothing found with query": an empty answer, not a failure.
_NOTHING_FOUND = 9003
_ERRORS_SHOWN = 5


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
    for error in errors[:_ERRORS_SHOWN]:
        if isinstance(error, dict):
            text = error.get("description") or error.get("error") or error.get("error_number")
        else:
            text = error
        texts.append(str(text)[:EXCERPT_CHARS])
    raise SlurmParseError("sacct reported errors: " + "; ".join(texts), source="sacct --json")


def _parse_json_job(raw: Mapping[str, Any], dialect: JsonDialect) -> SlurmJob:
    state_raw = _state_text(raw.get("state"))
    state = JobState.parse(state_raw)
    exit_code, exit_signal = _exit(raw.get("exit_code"), dialect, state)
    derived_code, derived_signal = _exit(raw.get("derived_exit_code"), dialect, None)
    times = _object(raw.get("time"), "time")
    array = _object(raw.get("array"), "array")
    het = _object(raw.get("het"), "het")
    comment = raw.get("comment")
    steps = tuple(
        _parse_json_step(_mapping(step, "step"), dialect)
        for step in _array(raw.get("steps"), "steps")
    )
    array_job_id = _job_number(array.get("job_id"), "array.job_id") or None
    array_task_id = _job_number(array.get("task_id"), "array.task_id") if array_job_id else None
    het_job_id = _job_number(het.get("job_id"), "het.job_id") or None
    name = str(raw.get("name") or "")
    user = str(raw.get("user") or "")
    work_dir = _optional_str(raw.get("working_directory"))
    job_id = _job_number(raw.get("job_id"), "job_id")
    if not job_id:
        raise SlurmParseError("no job_id", source="sacct --json")
    context = PathContext(
        job_id=job_id,
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
        uid=_number(raw.get("uid"), "uid", 0, MAX_UID),
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
        submit_time=_epoch(times.get("submission"), "time.submission"),
        start_time=_epoch(times.get("start"), "time.start"),
        end_time=_epoch(times.get("end"), "time.end"),
        stdout_path=stdout,
        stderr_path=stderr,
        work_dir=work_dir,
        comment=_optional_str(comment.get("job")) if isinstance(comment, dict) else None,
        restart_count=_number(raw.get("restart_cnt"), "restart_cnt", 0, MAX_COUNT) or 0,
        array_job_id=array_job_id,
        array_task_id=array_task_id,
        het_job_id=het_job_id,
        het_job_offset=_job_number(het.get("job_offset"), "het.job_offset") if het_job_id else None,
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
    stdout = _path(raw.get("stdout_expanded"))
    stderr = _path(raw.get("stderr_expanded"))
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
    step = _object(raw.get("step"), "step.step")
    step_id = step.get("id")
    state_raw = _state_text(raw.get("state"))
    state = JobState.parse(state_raw)
    exit_code, exit_signal = _exit(raw.get("exit_code"), dialect, state)
    times = _object(raw.get("time"), "step.time")
    nodes = _object(raw.get("nodes"), "step.nodes")
    return SlurmStep(
        step_id=_step_suffix(str(step_id if step_id is not None else "")),
        name=str(step.get("name") or ""),
        state=state,
        state_raw=state_raw,
        exit_code=exit_code,
        exit_signal=exit_signal,
        nodes=expand_hostlist(_optional_str(nodes.get("range"))),
        start_time=_epoch(times.get("start"), "step.time.start"),
        end_time=_epoch(times.get("end"), "step.time.end"),
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
    status_text = (
        " ".join(str(status) for status in statuses)
        if isinstance(statuses, list)
        else str(statuses or "")
    )
    signal_obj = value.get("signal") or {}
    signal = None
    if isinstance(signal_obj, dict):
        signal = _number(signal_obj.get("id", signal_obj.get("signal_id")), "signal", 0, MAX_SIGNAL)
    code = _number(value.get("return_code"), "return_code", MIN_EXIT_CODE, MAX_EXIT_CODE)
    if "SIGNALED" in status_text:
        return code, signal
    untrusted_success = dialect is JsonDialect.DBV0_0_38 and status_text == "SUCCESS"
    if untrusted_success and state is not JobState.COMPLETED:
        return None, None
    return code, ((signal or 0) if code is not None else signal)


# Digits read as a number: ASCII only (int() also takes "²"'s kin and "1_000"), and few enough
# that int() is cheap; the range check comes after.
_INTEGER = re.compile(r"-?[0-9]{1,20}")


def _number(value: Any, what: str, low: int, high: int) -> int | None:
    """A plain int, ASCII digits, or the no-value struct `{set, infinite, number}` of v0.0.40+,
    within `low..high`; None where Slurm says there is none."""
    if isinstance(value, dict):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value.strip())
    if not isinstance(value, int):
        raise SlurmParseError(
            f"{what}: expected an integer, got {repr(value)[:40]}", source="sacct"
        )
    if not low <= value <= high:
        shown = str(value) if value.bit_length() <= 64 else f"a {value.bit_length()}-bit number"
        raise SlurmParseError(f"{what} {shown} is outside {low}..{high}", source="sacct")
    return value


def _job_number(value: Any, what: str) -> int | None:
    """Job ids, array task ids and het offsets: Slurm's 32 unsigned bits."""
    return _number(value, what, 0, MAX_JOB_ID)


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text if text else None


def _path(value: Any) -> str | None:
    """A path accounting expanded; None (unknown) where it cannot be one, as expand_std_path."""
    text = _optional_str(value)
    if text is None or len(text) > MAX_PATH_CHARS or "\x00" in text:
        return None
    return text


def _epoch(value: Any, what: str) -> datetime | None:
    """Epoch seconds; Slurm's 0 (not yet) is None, and only times a record can hold pass."""
    seconds = _number(value, what, 0, MAX_EPOCH_SECONDS)
    if not seconds:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SlurmParseError(f"{what} is {type(value).__name__}, not an object", source="sacct")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    """An optional object: absent or null reads as empty."""
    return {} if value is None else _mapping(value, what)


def _array(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SlurmParseError(f"{what} is {type(value).__name__}, not a list", source="sacct")
    return value


# ---------------------------------------------------------------------------------------------
# --parsable2 fallback


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
                f"job {key}: {_detail(error)}", source=_PARSABLE, excerpt=excerpt
            )
            raw = "\n".join(row.text for row in groups[key])
            rejected.append(RejectedRecord.of(reason, key, raw))
    if nothing_read_is_error:
        _raise_if_nothing_read(jobs, rejected, _PARSABLE)
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
    job_id = _number(row["JobIDRaw"], "JobIDRaw", 1, MAX_JOB_ID)
    if job_id is None:
        raise SlurmParseError("JobIDRaw is not a number", source=_PARSABLE, excerpt=row["JobIDRaw"])
    state_raw = row["State"]
    return SlurmJob(
        job_id=job_id,
        name=row["JobName"],
        user=row["User"],
        uid=_number(row["UID"] or None, "UID", 0, MAX_UID),
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


_DISPLAY_ID = re.compile(r"([0-9]{1,10})(?:_([0-9]{1,10})|\+([0-9]{1,10}))?(?:\..*)?\Z")


def _display_id_parts(text: str) -> tuple[int | None, int | None, int | None, int | None]:
    """`123_4` is array 123 task 4; `123+1` is het job 123 component 1; else none."""
    match = _DISPLAY_ID.match(text)
    if not match:
        return None, None, None, None
    base = _job_number(match.group(1), "JobID")
    if match.group(2) is not None:
        return base, _job_number(match.group(2), "JobID"), None, None
    if match.group(3) is not None:
        return None, None, base, _job_number(match.group(3), "JobID")
    return None, None, None, None


def _colon_pair(text: str) -> tuple[int | None, int | None]:
    """`1:0` (exit code, signal); either side may be empty."""
    code, _, signal = text.partition(":")
    if not all(part == "" or _INTEGER.fullmatch(part) for part in (code, signal)):
        raise SlurmParseError("exit code is not N:M", source=_PARSABLE, excerpt=text)
    return (
        _number(code or None, "exit code", MIN_EXIT_CODE, MAX_EXIT_CODE),
        _number(signal or None, "exit signal", 0, MAX_SIGNAL),
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
