"""sacct's JSON, of several releases: the dialect from `meta`, then each job record alone.

JSON shapes differ by release, so the parser reads `meta` first and picks the dialect from it:
`openapi/dbv0.0.38` (22.05) or `data_parser/v0.0.40`+ (23.11 and later). Apart from the argv
builders (`sacct`) and the --parsable2 fallback (`sacct_parsable`) because it is the one
reader of a nested document whose fields move between releases.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
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
from daemon.slurm.sacct import (
    MAX_JSON_BYTES,
    JsonDialect,
    SacctReport,
    batch_host_of,
    bounded_number,
    error_detail,
    job_number,
    raise_if_nothing_read,
)


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
                f"job #{index}: {error_detail(error)}", source=source, excerpt=raw_text
            )
            rejected.append(RejectedRecord.of(reason, _json_job_id(raw), raw_text))
    if nothing_read_is_error:
        raise_if_nothing_read(jobs, rejected, source)
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
    array_job_id = job_number(array.get("job_id"), "array.job_id") or None
    array_task_id = job_number(array.get("task_id"), "array.task_id") if array_job_id else None
    het_job_id = job_number(het.get("job_id"), "het.job_id") or None
    name = str(raw.get("name") or "")
    user = str(raw.get("user") or "")
    work_dir = _optional_str(raw.get("working_directory"))
    job_id = job_number(raw.get("job_id"), "job_id")
    if not job_id:
        raise SlurmParseError("no job_id", source="sacct --json")
    context = PathContext(
        job_id=job_id,
        name=name,
        user=user,
        first_node=batch_host_of(steps),
        array_job_id=array_job_id,
        array_task_id=array_task_id,
    )
    stdout, stderr, source = _std_paths(raw, dialect, context, work_dir)
    return SlurmJob(
        job_id=context.job_id,
        name=name,
        user=user,
        uid=bounded_number(raw.get("uid"), "uid", 0, MAX_UID),
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
        batch_host=batch_host_of(steps),
        submit_time=_epoch(times.get("submission"), "time.submission"),
        start_time=_epoch(times.get("start"), "time.start"),
        end_time=_epoch(times.get("end"), "time.end"),
        stdout_path=stdout,
        stderr_path=stderr,
        work_dir=work_dir,
        comment=_optional_str(comment.get("job")) if isinstance(comment, dict) else None,
        restart_count=bounded_number(raw.get("restart_cnt"), "restart_cnt", 0, MAX_COUNT) or 0,
        array_job_id=array_job_id,
        array_task_id=array_task_id,
        het_job_id=het_job_id,
        het_job_offset=job_number(het.get("job_offset"), "het.job_offset") if het_job_id else None,
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
        signal = bounded_number(
            signal_obj.get("id", signal_obj.get("signal_id")), "signal", 0, MAX_SIGNAL
        )
    code = bounded_number(value.get("return_code"), "return_code", MIN_EXIT_CODE, MAX_EXIT_CODE)
    if "SIGNALED" in status_text:
        return code, signal
    untrusted_success = dialect is JsonDialect.DBV0_0_38 and status_text == "SUCCESS"
    if untrusted_success and state is not JobState.COMPLETED:
        return None, None
    return code, ((signal or 0) if code is not None else signal)


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
    seconds = bounded_number(value, what, 0, MAX_EPOCH_SECONDS)
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
