"""Fuzz suite of the Slurm-output parsers: hostlists, sacct (JSON and --parsable2), scontrol
and sbatch's output-path patterns, seeded with real 22.05 samples (tests/data/slurm) and with
the hostile inputs of issue 10.

The properties, for every parser: SlurmParseError is the only error that escapes; every value
that reaches a record is in range (ids, uids, exit codes, times a datetime and the store can
hold, valid node names, at most MAX_HOSTLIST_NAMES of them); and one corrupted record in a
batch leaves every other record parsed exactly as without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import (
    MAX_HOSTLIST_NAMES,
    NODE_NAME,
    count_hostlist,
    expand_hostlist,
    fold_hostlist,
)
from daemon.slurm.paths import MAX_PATH_CHARS, PathContext, expand_std_path
from daemon.slurm.records import (
    MAX_COUNT,
    MAX_EXIT_CODE,
    MAX_JOB_ID,
    MAX_SIGNAL,
    MAX_UID,
    MIN_EXIT_CODE,
    JobState,
    NodeBaseState,
    SlurmJob,
    SlurmNode,
    SlurmStep,
)
from daemon.slurm.sacct import PARSABLE_DELIMITER, PARSABLE_FIELDS, SacctReport
from daemon.slurm.sacct_json import parse_sacct_json
from daemon.slurm.sacct_parsable import parse_sacct_parsable
from daemon.slurm.scontrol import (
    parse_node_state,
    parse_nodes_json,
    parse_show_job,
    parse_show_nodes,
)

REAL = Path(__file__).parent / "data" / "slurm" / "dbv0.0.38"
SCHEMA = Path(__file__).parent / "data" / "slurm" / "schema"
# Zones at both ends of the offsets in use: a time at the edge of datetime's range in one of
# them is out of range in UTC.
ZONES: tuple[tzinfo, ...] = (
    UTC,
    timezone(timedelta(hours=14)),
    timezone(timedelta(hours=-12)),
)
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, tzinfo=UTC)

# The inputs issue 10 found crashing these parsers, and their kin.
HOSTILE_TEXT = [
    "²",
    "\u0661\u0662",
    "1_000",
    "+5",
    " 7 ",
    "-1",
    "9" * 30,
    "9" * 5000,
    "[----]",
    "n[0-99999999]",
    "n[0-65536]",
    "gpu-[01-",
    "@all",
    "a!b",
    "n[5-1]",
    "n[01-100]",
    "0001-01-01T00:00:00",
    "9999-12-31T23:59:59",
    "\u0662\u0660\u0662\u0666-11-22T03:12:58",
    "(null)",
    "\x00",
    "Reason=x [root@2026-11-22T03:12:58]",
]
HOSTILE_JSON: list[Any] = [
    10**19,
    -(10**19),
    2**63,
    2**64 + 1,
    10**4000,
    -1,
    1e308,
    float("inf"),
    float("nan"),
    True,
    {"set": True, "infinite": False, "number": 10**19},
    {"set": True, "number": "²"},
    [],
    {},
    *HOSTILE_TEXT,
]


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


# -- what every parsed record must hold --------------------------------------------------------


def _check_time(moment: datetime | None) -> None:
    if moment is not None:
        assert moment.tzinfo is not None
        assert EARLIEST <= moment <= LATEST


def _check_nodes(nodes: tuple[str, ...]) -> None:
    assert len(nodes) <= MAX_HOSTLIST_NAMES
    assert all(NODE_NAME.fullmatch(name) for name in nodes)


def _check_exit(code: int | None, signal: int | None) -> None:
    assert code is None or MIN_EXIT_CODE <= code <= MAX_EXIT_CODE
    assert signal is None or 0 <= signal <= MAX_SIGNAL


def _check_step(step: SlurmStep) -> None:
    assert isinstance(step.state, JobState)
    _check_exit(step.exit_code, step.exit_signal)
    _check_nodes(step.nodes)
    _check_time(step.start_time)
    _check_time(step.end_time)


def _check_job(job: SlurmJob) -> None:
    assert 1 <= job.job_id <= MAX_JOB_ID
    assert job.uid is None or 0 <= job.uid <= MAX_UID
    assert 0 <= job.restart_count <= MAX_COUNT
    for number in (job.array_job_id, job.array_task_id, job.het_job_id, job.het_job_offset):
        assert number is None or 0 <= number <= MAX_JOB_ID
    _check_exit(job.exit_code, job.exit_signal)
    _check_exit(job.derived_exit_code, job.derived_exit_signal)
    _check_nodes(job.nodes)
    for moment in (job.submit_time, job.start_time, job.end_time):
        _check_time(moment)
    for path in (job.stdout_path, job.stderr_path):
        assert path is None or len(path) <= MAX_PATH_CHARS
    for step in job.steps:
        _check_step(step)


def _check_report(report: SacctReport) -> None:
    for job in report.jobs:
        _check_job(job)
    for record in report.rejected:
        assert len(record.excerpt) <= 200
        assert record.reason


def _check_node(node: SlurmNode) -> None:
    assert NODE_NAME.fullmatch(node.name)
    _check_time(node.reason_time)


# -- hostlists -----------------------------------------------------------------------------------

_HOSTLIST_PIECES = st.lists(
    st.one_of(
        st.sampled_from(["gpu-", "n", "a.b", "x_", "0", "-", ".", ","]),
        st.builds(
            lambda low, span, width: f"[{low:0{width}d}-{low + span:0{width}d}]",
            st.integers(0, 10**6),
            st.integers(0, 10**6),
            st.integers(1, 8),
        ),
        st.sampled_from(["[1,3,5]", "[07]", "[]", "[1-2,4-6]", "[²]", "[1/2]"]),
        st.text(alphabet="[]0123456789,-²\u0661 .@!^&()", max_size=6),
    ),
    max_size=6,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_HOSTLIST_PIECES)
@example(text="[----]")
@example(text="n[0-99999999]")
@example(text="n[0-65536]")
@example(text="a[0-255]b[0-256]")
@example(text="n[²]")
@example(text="n[\u0661-\u0663]")
@example(text="n" + "9" * 5000)
@example(text="@all")
@example(text="gpu-01 gpu-02")
@example(text="-n")
@example(text="n9999999999[0-9999]")
def test_hostlists_expand_within_bounds_or_fail_cleanly(text: str) -> None:
    try:
        names = expand_hostlist(text)
    except SlurmParseError:
        return
    _check_nodes(names)
    if names:
        assert len(names) <= count_hostlist(text.strip())
        assert set(expand_hostlist(fold_hostlist(names))) == set(names)


@pytest.mark.parametrize("text", ["n[0-99999999]", "n[0-65536]", "a[0-255]b[0-256]"])
def test_hostlists_beyond_the_cap_are_refused_before_expansion(text: str) -> None:
    with pytest.raises(SlurmParseError, match=f"more than {MAX_HOSTLIST_NAMES} nodes"):
        expand_hostlist(text)


def test_a_hostlist_at_the_cap_still_expands() -> None:
    names = expand_hostlist("n[0-65535]")
    assert (len(names), names[0], names[-1]) == (MAX_HOSTLIST_NAMES, "n0", "n65535")


@pytest.mark.parametrize(
    "text", ["[----]", "@all", "a!b", "a^b", "a&b", "n[²]", "n[\u0661-\u0663]"]
)
def test_nodeset_syntax_beyond_slurm_hostlists_is_refused(text: str) -> None:
    """Group names and set operators would reach ClusterShell's resolvers and operators."""
    with pytest.raises(SlurmParseError, match="hostlist"):
        expand_hostlist(text)


@pytest.mark.parametrize("names", [["gpu-01", "-x"], ["a,b"], ["n[1-2]"], ["@all"], [""]])
def test_folding_refuses_what_is_not_a_node_name(names: list[str]) -> None:
    with pytest.raises(ValueError, match="not a node name"):
        fold_hostlist(names)


# -- sacct --json -------------------------------------------------------------------------------


def _json_batch() -> dict[str, Any]:
    """Every real 22.05 job in one sacct answer: 11 jobs, each with its steps."""
    names = sorted(path.stem for path in REAL.glob("*.json"))
    document: dict[str, Any] = json.loads(_text(REAL / "failed.json"))
    document["jobs"] = [
        job for name in names for job in json.loads(_text(REAL / f"{name}.json"))["jobs"]
    ]
    return document


JSON_BATCH = _json_batch()
JSON_BASELINE = parse_sacct_json(json.dumps(JSON_BATCH)).jobs


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*prefix, index))


JSON_TARGETS = [
    (index, path)
    for index, job in enumerate(JSON_BATCH["jobs"])
    for path in _paths(job)
    if path  # the whole job replaced is a target too, through its own keys' parents
]
_JSON_VALUES = st.one_of(
    st.sampled_from(HOSTILE_JSON),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=5), children, max_size=3)
        ),
        max_leaves=6,
    ),
)


def _set(document: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


@settings(max_examples=300, deadline=None)
@given(target=st.sampled_from(JSON_TARGETS), value=_JSON_VALUES)
@example(target=(0, ("time", "end")), value=10**19)
@example(target=(0, ("time", "start")), value=-1)
@example(target=(0, ("job_id",)), value=2**32)
@example(target=(0, ("uid",)), value="²")
@example(target=(0, ("restart_cnt",)), value="²")
@example(target=(0, ("nodes",)), value="[----]")
@example(target=(0, ("nodes",)), value="n[0-99999999]")
@example(target=(0, ("steps", 0, "nodes", "range")), value="n[0-99999999]")
@example(target=(0, ("exit_code", "return_code")), value=10**4000)
@example(target=(0, ("array", "task_id")), value=float("nan"))
def test_one_corrupted_json_job_leaves_the_others_as_they_were(
    target: tuple[int, tuple[Any, ...]], value: Any
) -> None:
    victim, path = target
    document = json.loads(json.dumps(JSON_BATCH))
    _set(document["jobs"][victim], path, value)
    report = parse_sacct_json(json.dumps(document))
    _check_report(report)
    others = [job for index, job in enumerate(JSON_BASELINE) if index != victim]
    if report.rejected:
        (rejected,) = report.rejected
        assert rejected.reason.startswith(f"job #{victim}:")
        assert list(report.jobs) == others
    else:
        assert [job for index, job in enumerate(report.jobs) if index != victim] == others


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_newer_dialects_read_mangled_or_fail_cleanly(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(path.name for path in SCHEMA.glob("*.json"))))
    document = json.loads(_text(SCHEMA / name))
    path = data.draw(st.sampled_from(list(_paths(document))[1:]))
    _set(document, path, data.draw(_JSON_VALUES))
    try:
        report = parse_sacct_json(json.dumps(document))
    except SlurmParseError:
        return
    _check_report(report)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "jobs": [' + "9" * 5000 + "]}",
        '{"meta": {"plugin": {"type": "openapi/dbv0.0.\u0663\u0668"}}, "jobs": []}',
        '{"meta": {"plugin": {"type": "' + "x" * 100_000 + '"}}, "jobs": []}',
        '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "errors": ['
        + ",".join(['{"error": "' + "e" * 1000 + '"}'] * 1000)
        + '], "jobs": []}',
        bytes(range(256)).decode("latin-1"),
    ],
)
def test_hostile_documents_are_one_bounded_parse_error(text: str) -> None:
    with pytest.raises(SlurmParseError) as caught:
        parse_sacct_json(text)
    assert len(str(caught.value)) < 2000


def test_a_job_ending_past_64_bits_is_rejected_alone_with_its_reason() -> None:
    """Issue 10's `time.end = 10**19`: an OverflowError from datetime before."""
    document = json.loads(json.dumps(JSON_BATCH))
    document["jobs"][1]["time"]["end"] = 10**19
    report = parse_sacct_json(json.dumps(document))
    assert [job.job_id for job in report.jobs] == [
        job.job_id for index, job in enumerate(JSON_BASELINE) if index != 1
    ]
    (rejected,) = report.rejected
    assert rejected.record_id == str(JSON_BATCH["jobs"][1]["job_id"])
    assert "time.end" in rejected.reason
    assert "is outside" in rejected.reason


# -- sacct --parsable2 --------------------------------------------------------------------------


def _parsable_batch() -> list[list[str]]:
    rows = []
    # The hostile sample's name and comment hold newlines: its rows are not one line each.
    for path in sorted(REAL.glob("*.parsable2")):
        if path.stem != "hostile":
            rows += [
                line.split(PARSABLE_DELIMITER) for line in _text(path).rstrip("\n").split("\n")
            ]
    return rows


PARSABLE_ROWS = _parsable_batch()


def _parsable_text(rows: list[list[str]]) -> str:
    return "".join(PARSABLE_DELIMITER.join(row) + "\n" for row in rows)


# JobIDRaw decides which job a row belongs to: changing it moves a row to another job.
_CORRUPTIBLE = [name for name in PARSABLE_FIELDS if name != "JobIDRaw"]
_ROW_VALUES = st.one_of(
    st.sampled_from(HOSTILE_TEXT),
    st.text(
        alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\n\x1f"),
        max_size=20,
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    row=st.integers(0, len(PARSABLE_ROWS) - 1),
    field=st.sampled_from(_CORRUPTIBLE),
    value=_ROW_VALUES,
    zone=st.sampled_from(ZONES),
)
@example(row=0, field="UID", value="²", zone=UTC)
@example(row=0, field="NodeList", value="[----]", zone=UTC)
@example(row=0, field="NodeList", value="n[0-99999999]", zone=UTC)
@example(row=1, field="NodeList", value="n[0-99999999]", zone=UTC)
@example(row=0, field="End", value="9999-12-31T23:59:59", zone=ZONES[2])
@example(row=0, field="Start", value="0001-01-01T00:00:00", zone=ZONES[1])
@example(row=0, field="ExitCode", value="9" * 5000 + ":0", zone=UTC)
@example(row=0, field="JobID", value="9" * 30 + "_1", zone=UTC)
def test_one_corrupted_parsable_row_leaves_the_other_jobs_as_they_were(
    row: int, field: str, value: str, zone: tzinfo
) -> None:
    baseline = parse_sacct_parsable(_parsable_text(PARSABLE_ROWS), local_tz=zone).jobs
    rows = [list(values) for values in PARSABLE_ROWS]
    rows[row][PARSABLE_FIELDS.index(field)] = value
    report = parse_sacct_parsable(_parsable_text(rows), local_tz=zone)
    _check_report(report)
    victim = int(PARSABLE_ROWS[row][PARSABLE_FIELDS.index("JobIDRaw")].partition(".")[0])
    assert [job for job in report.jobs if job.job_id != victim] == [
        job for job in baseline if job.job_id != victim
    ]
    assert all(record.record_id == str(victim) for record in report.rejected)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_parsable_text_reads_or_fails_cleanly(data: st.DataObject) -> None:
    """Framing included: delimiters and newlines dropped or added anywhere."""
    text = _parsable_text(PARSABLE_ROWS)
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 40)))
    filler = data.draw(st.text(alphabet="\x1f\n:_.+-0123456789²[]T", max_size=12))
    try:
        report = parse_sacct_parsable(text[:start] + filler + text[end:], local_tz=UTC)
    except SlurmParseError:
        return
    _check_report(report)


def test_a_uid_in_superscript_is_rejected_alone() -> None:
    rows = [list(values) for values in PARSABLE_ROWS]
    rows[0][PARSABLE_FIELDS.index("UID")] = "²"
    report = parse_sacct_parsable(_parsable_text(rows), local_tz=UTC)
    (rejected,) = report.rejected
    assert rejected.record_id == rows[0][PARSABLE_FIELDS.index("JobIDRaw")]
    assert "UID: expected an integer" in rejected.reason
    assert len(report.jobs) == len(parse_sacct_parsable(_parsable_text(PARSABLE_ROWS)).jobs) - 1


# -- scontrol -----------------------------------------------------------------------------------

_FIELD = re.compile(r"(?<=\s)([A-Za-z][A-Za-z0-9_:/]*)=")
SHOW_JOB = _text(REAL / "scontrol-show-job-failed.txt")
SHOW_JOB_KEYS = sorted(set(_FIELD.findall(SHOW_JOB)) - {"JobName", "UserId", "GroupId"})


def _with_field(record: str, key: str, value: str) -> str:
    """`record` with the first `key=`'s value (up to the next space) replaced."""
    match = re.search(rf"(?<=\s){re.escape(key)}=\S*", record)
    assert match is not None
    return record[: match.start()] + f"{key}={value}" + record[match.end() :]


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(["JobId", *SHOW_JOB_KEYS]), value=_ROW_VALUES)
@example(key="Restarts", value="²")
@example(key="Restarts", value="9" * 5000)
@example(key="NodeList", value="[----]")
@example(key="NodeList", value="n[0-99999999]")
@example(key="JobId", value="\u0661\u0662")
@example(key="JobId", value=str(2**32))
def test_show_job_reads_in_range_or_fails_cleanly(key: str, value: str) -> None:
    text = (
        "JobId=" + value + SHOW_JOB[len("JobId=5") :]
        if key == "JobId"
        else _with_field(SHOW_JOB, key, value)
    )
    try:
        job = parse_show_job(text)
    except SlurmParseError:
        return
    assert 1 <= job.job_id <= MAX_JOB_ID
    assert 0 <= job.restart_count <= MAX_COUNT
    _check_nodes(job.nodes)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("Restarts", "²", "Restarts is not a count"),
        ("NodeList", "[----]", "hostlist"),
        ("NodeList", "n[0-99999999]", "more than 65536 nodes"),
    ],
)
def test_issue_10_show_job_inputs_are_parse_errors(key: str, value: str, message: str) -> None:
    with pytest.raises(SlurmParseError, match=re.escape(message)):
        parse_show_job(_with_field(SHOW_JOB, key, value))


NODE_LINES = [line for line in _text(REAL / "scontrol-show-nodes.txt").split("\n") if line]
NODES_BASELINE = [parse_show_nodes(line, local_tz=ZONES[1]).nodes[0] for line in NODE_LINES]


@settings(max_examples=300, deadline=None)
@given(
    victim=st.integers(0, len(NODE_LINES) - 1),
    key=st.sampled_from(["NodeName", "State", "NodeAddr", "Gres", "Reason", "Weight"]),
    value=_ROW_VALUES,
)
@example(victim=2, key="Reason", value="x [root@9999-12-31T23:59:59]")
@example(victim=2, key="Reason", value="[" * 3000 + "@")
@example(victim=0, key="NodeName", value="-rf")
@example(victim=0, key="NodeName", value="gpu-[01-04]")
def test_one_corrupted_node_line_leaves_the_other_nodes_as_they_were(
    victim: int, key: str, value: str
) -> None:
    lines = list(NODE_LINES)
    if f" {key}=" in f" {lines[victim]}":
        lines[victim] = _with_field(f" {lines[victim]}", key, value)[1:]
    else:
        lines[victim] = f"{lines[victim]} {key}={value}"
    report = parse_show_nodes("\n".join(lines) + "\n", local_tz=ZONES[1])
    for node in report.nodes:
        _check_node(node)
    others = [node for index, node in enumerate(NODES_BASELINE) if index != victim]
    if report.rejected:
        assert list(report.nodes) == others
    else:
        assert [node for index, node in enumerate(report.nodes) if index != victim] == others


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80), value=_JSON_VALUES)
@example(text="IDLE+DRAIN", value={"set": True, "number": 10**19})
@example(text="²", value=-(10**19))
def test_node_states_and_json_nodes_read_or_fail_cleanly(text: str, value: Any) -> None:
    base, flags = parse_node_state(text)
    assert base in set(NodeBaseState)
    assert isinstance(flags, frozenset)
    document = {
        "nodes": [
            {"name": "gpu-01", "state": [text], "reason_changed_at": value},
            {"name": value, "state": ["IDLE"]},
            {"name": "gpu-02", "state": "IDLE"},
        ]
    }
    report = parse_nodes_json(json.dumps(document))
    assert [node.name for node in report.nodes][-1] == "gpu-02"
    for node in report.nodes:
        _check_node(node)


# -- output path patterns -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    pattern=st.text(alphabet="%0123456789jxuNAaJstn/\\.-", max_size=60),
    name=st.text(max_size=40),
    repeat=st.integers(1, 200),
)
@example(pattern="%" + "9" * 5000 + "j", name="x", repeat=1)
@example(pattern="%x", name="n" * 100, repeat=100)
@example(pattern="%99999999999999999999999a", name="x", repeat=1)
def test_std_path_patterns_expand_to_a_bounded_path_or_none(
    pattern: str, name: str, repeat: int
) -> None:
    context = PathContext(job_id=7, name=name, user="alice", first_node="gpu-01")
    path = expand_std_path(pattern * repeat, context, work_dir="/home/alice")
    assert path is None or (len(path) <= MAX_PATH_CHARS and "\x00" not in path)


def test_a_pattern_expanding_past_path_max_is_no_path() -> None:
    context = PathContext(job_id=7, name="n" * 100, user="alice")
    assert expand_std_path("%x" * 100, context) is None
    assert expand_std_path("%" + "9" * 4000 + "j", context) == "0000000007"
