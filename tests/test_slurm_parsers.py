"""Parsers of sacct/scontrol/sbatch output, on real 22.05 samples and schema-built newer ones."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist, fold_hostlist
from daemon.slurm.records import JobState, NodeBaseState, PathSource, SlurmJob, printable
from daemon.slurm.sacct import PARSABLE_DELIMITER, PARSABLE_FIELDS, JsonDialect
from daemon.slurm.sacct_json import parse_sacct_json
from daemon.slurm.sacct_parsable import fill_exit_codes, parse_sacct_parsable
from daemon.slurm.sbatch import parse_sbatch_parsable
from daemon.slurm.scontrol import (
    parse_node_state,
    parse_nodes_json,
    parse_show_job,
    parse_show_nodes,
)

DATA = Path(__file__).parent / "data" / "slurm"
REAL = DATA / "dbv0.0.38"
SCHEMA = DATA / "schema"


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _only(name: str) -> SlurmJob:
    report = parse_sacct_json(_text(REAL / f"{name}.json"))
    assert len(report.jobs) == 1
    return report.jobs[0]


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# -- real 22.05 samples -----------------------------------------------------------------------


def test_failed_four_node_job_reads_every_field() -> None:
    report = parse_sacct_json(_text(REAL / "failed.json"))
    assert report.dialect is JsonDialect.DBV0_0_38
    assert report.slurm_release == "22.05.8"
    job = report.jobs[0]
    assert job.job_id == 5
    assert job.name == "train-4node"
    assert (job.user, job.group, job.account, job.partition) == (
        "alice",
        "alice",
        "training",
        "gpu",
    )
    assert job.state is JobState.FAILED
    assert job.state_raw == "FAILED"
    assert job.nodes == ("gpu-01", "gpu-02", "gpu-03", "gpu-04")
    assert job.batch_host == "gpu-01"
    assert job.comment == "tok-failed"
    assert job.cluster == "medic-dev"
    assert job.work_dir == "/tmp/medic-samples"
    assert job.submit_time == _at("2026-11-22T03:12:41")
    assert job.start_time == _at("2026-11-22T03:12:42")
    assert job.end_time == _at("2026-11-22T03:12:42")
    assert [(step.step_id, step.name, step.state) for step in job.steps] == [
        ("batch", "batch", JobState.FAILED),
        ("0", "bash", JobState.FAILED),
    ]
    assert job.steps[1].nodes == job.nodes
    # 22.05 prints SUCCESS/0 for this exit 1: unknown, never a false 0.
    assert job.exit_code is None
    assert job.derived_exit_code is None
    assert job.std_paths_source is PathSource.UNKNOWN
    assert job.stdout_path is None


def test_parsable2_fallback_has_the_exit_codes_json_lost() -> None:
    json_job = _only("failed")
    fallback = parse_sacct_parsable(_text(REAL / "failed.parsable2"), local_tz=UTC).jobs[0]
    assert (fallback.exit_code, fallback.exit_signal) == (1, 0)
    assert fallback.derived_exit_code == 1
    merged = fill_exit_codes(json_job, fallback)
    assert (merged.exit_code, merged.exit_signal, merged.derived_exit_code) == (1, 0, 1)
    assert [(step.step_id, step.exit_code) for step in merged.steps] == [("batch", 1), ("0", 1)]
    assert merged.comment == "tok-failed"


def test_cancelled_keeps_signal_and_who() -> None:
    job = _only("cancelled")
    assert job.state is JobState.CANCELLED
    assert job.killed_by == "root"
    assert [(s.step_id, s.state, s.exit_signal) for s in job.steps] == [
        ("batch", JobState.CANCELLED, 15),
        ("0", JobState.CANCELLED, 15),
    ]
    fallback = parse_sacct_parsable(_text(REAL / "cancelled.parsable2"), local_tz=UTC).jobs[0]
    assert fallback.state_raw == "CANCELLED by 0"
    assert fallback.killed_by == "0"


def test_timeout_and_node_fail() -> None:
    timeout = _only("timeout")
    assert timeout.state is JobState.TIMEOUT
    assert timeout.end_time == _at("2026-11-22T03:14:10")
    assert [s.exit_signal for s in timeout.steps] == [15, 15]
    node_fail = _only("node-fail")
    assert node_fail.state is JobState.NODE_FAIL
    assert node_fail.nodes == ("gpu-04",)
    assert [s.state for s in node_fail.steps] == [JobState.CANCELLED, JobState.CANCELLED]


def test_array_tasks_are_separate_jobs_with_array_ids() -> None:
    jobs = parse_sacct_json(_text(REAL / "array.json")).jobs
    assert sorted((j.display_id, j.job_id, j.state.value) for j in jobs) == [
        ("9_0", 15, "COMPLETED"),
        ("9_1", 16, "FAILED"),
        ("9_2", 9, "COMPLETED"),
    ]
    completed = next(j for j in jobs if j.display_id == "9_0")
    assert (completed.exit_code, completed.exit_signal) == (0, 0)
    fallback = parse_sacct_parsable(_text(REAL / "array.parsable2"), local_tz=UTC).jobs
    assert [(j.display_id, j.job_id, j.exit_code) for j in fallback] == [
        ("9_0", 15, 0),
        ("9_1", 16, 3),
        ("9_2", 9, 0),
    ]


def test_multi_step_job_nests_every_step() -> None:
    job = _only("multi-step")
    assert job.state is JobState.COMPLETED
    assert [(s.step_id, s.name, s.state) for s in job.steps] == [
        ("batch", "batch", JobState.COMPLETED),
        ("0", "true", JobState.COMPLETED),
        ("1", "bash", JobState.FAILED),
        ("2", "hostname", JobState.COMPLETED),
    ]
    fallback = parse_sacct_parsable(_text(REAL / "multi-step.parsable2"), local_tz=UTC).jobs[0]
    assert fallback.derived_exit_code == 7
    assert [(s.step_id, s.exit_code) for s in fallback.steps] == [
        ("batch", 0),
        ("0", 0),
        ("1", 7),
        ("2", 0),
    ]


def test_het_components() -> None:
    jobs = parse_sacct_json(_text(REAL / "het.json")).jobs
    assert [(j.display_id, j.het_job_id, j.het_job_offset, j.nodes) for j in jobs] == [
        ("12+0", 12, 0, ("gpu-02",)),
        ("12+1", 12, 1, ("gpu-04",)),
    ]
    fallback = parse_sacct_parsable(_text(REAL / "het.parsable2"), local_tz=UTC).jobs
    assert [(j.display_id, j.job_id) for j in fallback] == [("12+0", 12), ("12+1", 13)]


def test_hostile_name_and_comment_come_back_as_accounting_stored_them() -> None:
    job = _only("hostile")
    assert job.name == "quote'`$(touch /tmp/pwned)`id`\nline2 ?? end"
    assert job.comment == "c'\"$(touch /tmp/pwned);`id` UserId=x(1) GroupId=y\n2nd ?"
    fallback = parse_sacct_parsable(_text(REAL / "hostile.parsable2"), local_tz=UTC).jobs[0]
    assert fallback.name == job.name
    assert fallback.comment == job.comment
    assert [s.step_id for s in fallback.steps] == ["batch"]


def test_memory_limit_was_not_enforced_before_the_cluster_confined_ram() -> None:
    job = _only("mem-not-enforced")
    assert job.state is JobState.COMPLETED


def test_a_cgroup_kill_is_recorded_on_the_step_not_the_job() -> None:
    job = _only("cgroup-oom")
    assert job.state is JobState.FAILED
    states = {step.step_id: step.state for step in job.steps}
    assert states == {"batch": JobState.FAILED, "0": JobState.OUT_OF_MEMORY}
    fallback = parse_sacct_parsable(_text(REAL / "cgroup-oom.parsable2"), local_tz=UTC).jobs[0]
    assert {step.step_id: step.state for step in fallback.steps} == states


# -- newer releases (schema-built) ------------------------------------------------------------


def test_v0_0_40_patterns_and_no_value_numbers() -> None:
    report = parse_sacct_json(_text(SCHEMA / "sacct-v0.0.40.json"))
    assert report.dialect is JsonDialect.V0_0_40
    assert report.slurm_release == "23.11.4"
    failed, oom = report.jobs
    assert (failed.state, failed.exit_code, failed.exit_signal) == (JobState.FAILED, 1, 0)
    assert failed.stdout_path == "/home/alice/run/train-llama-101.out"
    assert failed.std_paths_source is PathSource.ACCOUNTING_PATTERN
    assert failed.start_time == datetime.fromtimestamp(1763780010, tz=UTC)
    assert failed.steps[1].end_time == datetime.fromtimestamp(1763780049, tz=UTC)
    assert oom.state is JobState.OUT_OF_MEMORY
    assert oom.array_job_id is None
    assert oom.het_job_id is None


def test_v0_0_41_expanded_paths_array_and_unknown_state() -> None:
    report = parse_sacct_json(_text(SCHEMA / "sacct-v0.0.41.json"))
    assert report.dialect is JsonDialect.V0_0_41
    sweep, future = report.jobs
    assert sweep.display_id == "200_1"
    assert sweep.stdout_path == "/home/alice/run/200_1.out"
    assert sweep.std_paths_source is PathSource.ACCOUNTING
    assert sweep.steps[0].start_time == datetime.fromtimestamp(1763780010, tz=UTC)
    assert future.state is JobState.UNKNOWN
    assert future.state_raw == "LAUNCH_FAILED"
    assert not future.state.is_terminal()
    assert future.comment == "medic:token=abc"


def test_v0_0_42_het_and_restarts() -> None:
    report = parse_sacct_json(_text(SCHEMA / "sacct-v0.0.42.json"))
    assert report.dialect is JsonDialect.V0_0_42
    first, second = report.jobs
    assert (first.display_id, first.restart_count, first.state) == ("301+0", 2, JobState.NODE_FAIL)
    assert [s.step_id for s in first.steps] == ["batch", "0+0"]
    assert second.display_id == "301+1"


def test_later_data_parser_is_read_like_v0_0_42() -> None:
    document = json.loads(_text(SCHEMA / "sacct-v0.0.42.json"))
    document["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.44"
    assert parse_sacct_json(json.dumps(document)).dialect is JsonDialect.V0_0_42


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 1, 100, 2000, 9000])
def test_truncated_json_is_a_clear_parse_error(cut: int) -> None:
    text = _text(REAL / "failed.json")[:cut]
    with pytest.raises(SlurmParseError, match="sacct --json"):
        parse_sacct_json(text)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("[]", "not an object"),
        ('{"jobs": []}', "no `meta`"),
        ('{"meta": {"plugin": {"type": "openapi/v9"}}, "jobs": []}', "unknown plugin"),
        ('{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}}', "no `jobs` list"),
        ('{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "jobs": [3]}', "not an object"),
        ('{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "jobs": [{}]}', "job #0"),
        (
            '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "jobs": '
            '[{"job_id": 1, "time": {"start": "soon"}}]}',
            "expected an integer",
        ),
        (
            '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "jobs": '
            '[{"job_id": 1, "nodes": "gpu-[01-"}]}',
            "hostlist",
        ),
        (
            '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "jobs": '
            '[{"job_id": 1, "time": [1, 2]}]}',
            "time is list, not an object",
        ),
        (
            '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "errors": '
            '[{"error": "Unable to connect to database"}], "jobs": []}',
            "Unable to connect to database",
        ),
    ],
)
def test_malformed_json_is_a_clear_parse_error(document: str, message: str) -> None:
    with pytest.raises(SlurmParseError, match=message):
        parse_sacct_json(document)


def test_binary_garbage_is_a_parse_error() -> None:
    garbage = bytes(range(256)).decode("latin-1") * 4
    with pytest.raises(SlurmParseError):
        parse_sacct_json(garbage)
    with pytest.raises(SlurmParseError):
        parse_sacct_parsable(garbage)


def test_truncated_parsable_row_is_a_parse_error() -> None:
    text = _text(REAL / "failed.parsable2")
    with pytest.raises(SlurmParseError, match="ends inside a row"):
        parse_sacct_parsable(text[: len(text) // 2])


def test_parsable_row_with_too_many_fields_is_a_parse_error() -> None:
    row = PARSABLE_DELIMITER.join(["1"] * (len(PARSABLE_FIELDS) + 1))
    with pytest.raises(SlurmParseError, match="fields"):
        parse_sacct_parsable(row)


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("FAILED", JobState.FAILED),
        ("CANCELLED by 1001", JobState.CANCELLED),
        ("COMPLETED+", JobState.COMPLETED),
        ("LAUNCH_FAILED", JobState.UNKNOWN),
        ("", JobState.UNKNOWN),
    ],
)
def test_state_spellings(text: str, state: JobState) -> None:
    assert JobState.parse(text) is state


# -- scontrol and sbatch ------------------------------------------------------------------------


def test_show_nodes_reads_drain_reason_user_and_time() -> None:
    nodes = parse_show_nodes(_text(REAL / "scontrol-show-nodes.txt"), local_tz=UTC).nodes
    assert [n.name for n in nodes] == ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]
    drained = nodes[2]
    assert drained.address == "10.77.0.13"
    assert drained.state is NodeBaseState.IDLE
    assert drained.flags == frozenset({"DRAIN"})
    assert drained.reason == "medic: sample capture drain"
    assert drained.reason_user == "root"
    assert drained.reason_time == _at("2026-11-22T03:12:58")
    assert drained.drained_by_medic
    assert nodes[0].state is NodeBaseState.MIXED
    assert not nodes[0].is_drained
    assert nodes[0].reason is None
    assert nodes[0].gres == "gpu:8"


def test_reason_holding_key_value_text_stays_whole() -> None:
    line = _text(REAL / "scontrol-show-node-drained.txt").replace(
        "Reason=medic: sample capture drain", "Reason=ops: State=DOWN Weight=9 by hand"
    )
    (node,) = parse_show_nodes(line, local_tz=UTC).nodes
    assert node.reason == "ops: State=DOWN Weight=9 by hand"
    assert node.state is NodeBaseState.IDLE
    assert not node.drained_by_medic


@pytest.mark.parametrize(
    ("text", "base", "flags"),
    [
        ("IDLE", NodeBaseState.IDLE, set()),
        ("IDLE+DRAIN", NodeBaseState.IDLE, {"DRAIN"}),
        ("DOWN*+DRAIN", NodeBaseState.DOWN, {"DRAIN", "NOT_RESPONDING"}),
        ("ALLOCATED+DRAIN+COMPLETING", NodeBaseState.ALLOCATED, {"DRAIN", "COMPLETING"}),
        ("DRAINED", NodeBaseState.IDLE, {"DRAIN"}),
        ("PLANNED_SOMETHING", NodeBaseState.UNKNOWN, {"PLANNED_SOMETHING"}),
    ],
)
def test_node_state_words(text: str, base: NodeBaseState, flags: set[str]) -> None:
    assert parse_node_state(text) == (base, frozenset(flags))


def test_nodes_json_of_newer_releases() -> None:
    document = {
        "nodes": [
            {
                "name": "gpu-02",
                "address": "10.77.0.12",
                "state": ["IDLE", "DRAIN"],
                "reason": "medic: xid 79",
                "reason_set_by_user": "slurm-medic",
                "reason_changed_at": {"set": True, "infinite": False, "number": 1763780000},
                "gres": "gpu:8",
            }
        ]
    }
    (node,) = parse_nodes_json(json.dumps(document)).nodes
    assert node.drained_by_medic
    assert node.reason_user == "slurm-medic"
    assert node.reason_time == datetime.fromtimestamp(1763780000, tz=UTC)
    with pytest.raises(SlurmParseError):
        parse_nodes_json('{"nodes": ')


def test_show_job_gives_std_paths_and_batch_host() -> None:
    job = parse_show_job(_text(REAL / "scontrol-show-job-failed.txt"))
    assert (job.job_id, job.name, job.user, job.state_raw) == (5, "train-4node", "alice", "FAILED")
    assert job.batch_host == "gpu-01"
    assert job.nodes == ("gpu-01", "gpu-02", "gpu-03", "gpu-04")
    assert job.stdout_path == "/tmp/medic-samples/train-4node-5.out"
    assert job.stderr_path == "/tmp/medic-samples/train-4node-5.out"
    assert job.work_dir == "/tmp/medic-samples"


def test_show_job_with_hostile_name_and_comment() -> None:
    job = parse_show_job(_text(REAL / "scontrol-show-job-hostile.txt"))
    assert job.name == "quote'\"$(touch /tmp/pwned)`id`\nline2 \ufffd\ufffd end"
    assert job.user == "alice"
    assert job.stdout_path == "/tmp/medic-samples/hostile-11.out"


@pytest.mark.parametrize("text", ["", "garbage", "JobId=x JobName=a UserId=b(1) GroupId=c(1)"])
def test_show_job_rejects_what_it_cannot_read(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_show_job(text)


def test_sbatch_parsable_answers() -> None:
    assert parse_sbatch_parsable(_text(REAL / "sbatch-parsable.txt")) == (5, None)
    assert parse_sbatch_parsable(_text(REAL / "sbatch-parsable-cluster.txt")) == (30, "medic-dev")
    assert parse_sbatch_parsable("sbatch: warning: x\n123;medic-dev\n") == (123, "medic-dev")
    for bad in ["", "Submitted batch job 12", "12;a;b", "-1", "0", "9" * 5000, "4294967296"]:
        with pytest.raises(SlurmParseError):
            parse_sbatch_parsable(bad)


def test_hostlists_through_nodeset() -> None:
    assert expand_hostlist("gpu-[01-03,07]") == ("gpu-01", "gpu-02", "gpu-03", "gpu-07")
    assert expand_hostlist("None assigned") == ()
    assert fold_hostlist(["gpu-03", "gpu-01", "gpu-02"]) == "gpu-[01-03]"
    with pytest.raises(SlurmParseError):
        expand_hostlist("gpu-[03-")


# -- property-based: odd names and comments survive every parser -----------------------------

_ODD_TEXT = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x1f"),
    max_size=60,
)


def _job_document(name: str, comment: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(_text(REAL / "failed.json"))
    document["jobs"][0]["name"] = name
    document["jobs"][0]["comment"]["job"] = comment
    return document


@settings(max_examples=150, deadline=None)
@given(name=_ODD_TEXT, comment=_ODD_TEXT)
def test_odd_names_and_comments_round_trip_through_json(name: str, comment: str) -> None:
    job = parse_sacct_json(json.dumps(_job_document(name, comment))).jobs[0]
    assert job.name == name
    assert job.comment == (comment or None)


@settings(max_examples=150, deadline=None)
@given(name=_ODD_TEXT, comment=_ODD_TEXT)
def test_odd_names_and_comments_round_trip_through_parsable2(name: str, comment: str) -> None:
    lines = _text(REAL / "failed.parsable2").split("\n")
    fields = lines[0].split(PARSABLE_DELIMITER)
    fields[PARSABLE_FIELDS.index("JobName")] = name
    fields[PARSABLE_FIELDS.index("Comment")] = comment
    text = "\n".join([PARSABLE_DELIMITER.join(fields), *lines[1:]])
    job = parse_sacct_parsable(text, local_tz=UTC).jobs[0]
    assert job.name == name
    assert job.comment == (comment or None)
    assert [s.step_id for s in job.steps] == ["batch", "0"]


@settings(max_examples=150, deadline=None)
@given(name=_ODD_TEXT.filter(lambda text: " UserId=" not in text))
def test_odd_names_round_trip_through_show_job(name: str) -> None:
    line = _text(REAL / "scontrol-show-job-failed.txt").replace(
        "JobName=train-4node ", f"JobName={name} ", 1
    )
    job = parse_show_job(line)
    assert job.name == name
    assert job.stdout_path == "/tmp/medic-samples/train-4node-5.out"


def test_nothing_found_is_an_empty_answer() -> None:
    """What 22.05 prints for a job slurmdbd has not recorded yet (seen on the dev cluster)."""
    document = {
        "meta": {"plugin": {"type": "openapi/dbv0.0.38"}},
        "errors": [
            {
                "description": "Nothing found",
                "error_number": 9003,
                "error": "Nothing found with query",
                "source": "slurmdb_jobs_get",
            }
        ],
        "jobs": [],
    }
    assert parse_sacct_json(json.dumps(document)).jobs == ()


def test_placeholder_record_of_a_job_that_ended_at_once_is_marked_incomplete() -> None:
    """Caught on the dev cluster: sacct polled every 50 ms after a job that ran for 0 s."""
    job = _only("placeholder-failed")
    assert job.state is JobState.FAILED
    assert (job.name, job.group, job.partition) == ("allocation", "root", None)
    assert job.nodes == ("gpu-01",)
    assert not job.accounting_complete
    assert _only("failed").accounting_complete


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


_SAMPLE_DOCUMENTS = [
    json.loads(_text(REAL / "multi-step.json")),
    json.loads(_text(SCHEMA / "sacct-v0.0.41.json")),
]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_mangled_document_parses_or_fails_cleanly(data: st.DataObject) -> None:
    """Whatever value lands wherever in a real document: a result or SlurmParseError, no crash."""
    document = json.loads(json.dumps(data.draw(st.sampled_from(_SAMPLE_DOCUMENTS))))
    path = data.draw(st.sampled_from(_paths(document)[1:]))
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = data.draw(_JSON_VALUES)
    try:
        report = parse_sacct_json(json.dumps(document))
    except SlurmParseError:
        return
    assert len(report.jobs) + len(report.rejected) == len(document["jobs"])
    assert all(isinstance(job.state, JobState) for job in report.jobs)
    assert all(isinstance(step.step_id, str) for job in report.jobs for step in job.steps)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mangled_scontrol_text_parses_or_fails_cleanly(data: st.DataObject) -> None:
    """Real scontrol lines with a stretch replaced by odd text: a record or SlurmParseError."""
    name = data.draw(st.sampled_from(["scontrol-show-job-failed.txt", "scontrol-show-nodes.txt"]))
    text = _text(REAL / name)
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 40)))
    filler = data.draw(st.text(alphabet="=[]@() \n+*:-,0123456789abXYZ", max_size=20))
    mangled = text[:start] + filler + text[end:]
    try:
        if name.startswith("scontrol-show-job"):
            job = parse_show_job(mangled)
            assert isinstance(job.job_id, int)
            assert job.restart_count >= 0
        else:
            nodes = parse_show_nodes(mangled, local_tz=UTC).nodes
            assert all(node.name for node in nodes)
    except SlurmParseError:
        return


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mangled_parsable2_parses_or_fails_cleanly(data: st.DataObject) -> None:
    text = _text(REAL / data.draw(st.sampled_from(["multi-step.parsable2", "array.parsable2"])))
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 30)))
    filler = data.draw(st.text(alphabet="\x1f\n:_.+-0123456789abT", max_size=12))
    try:
        report = parse_sacct_parsable(text[:start] + filler + text[end:], local_tz=UTC)
    except SlurmParseError:
        return
    assert all(isinstance(job.job_id, int) for job in report.jobs)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("UID", "alice", "expected an integer"),
        ("ExitCode", "1-0", "N:M"),
        ("Start", "yesterday", "YYYY"),
        ("JobIDRaw", "abc", "not a number"),
        ("NodeList", "gpu-[1-", "hostlist"),
    ],
)
def test_bad_parsable2_values_are_parse_errors(field: str, value: str, message: str) -> None:
    line = _text(REAL / "failed.parsable2").split("\n")[0]
    fields = line.split(PARSABLE_DELIMITER)
    fields[PARSABLE_FIELDS.index(field)] = value
    with pytest.raises(SlurmParseError, match=message):
        parse_sacct_parsable(PARSABLE_DELIMITER.join(fields), local_tz=UTC)


def test_a_rejected_parsable_job_keeps_its_rows_as_printable_text() -> None:
    """Job 5's rows, its exit code mangled: rejected with every row of it, delimiters and
    newlines escaped, so that the text on the record is one printable line that restores."""
    rows = _text(REAL / "failed.parsable2").replace(
        f"{PARSABLE_DELIMITER}1:0", f"{PARSABLE_DELIMITER}x", 1
    )
    others = _text(REAL / "timeout.parsable2")
    report = parse_sacct_parsable(rows + others, nothing_read_is_error=False)
    assert [job.job_id for job in report.jobs] == [7]
    (rejected,) = report.rejected
    assert (rejected.record_id, rejected.raw_chars) == ("5", len(rows) - 1)
    assert rejected.raw.isprintable()
    assert rejected.raw.encode().decode("unicode_escape") == rows[:-1]
    assert "\\x1f" in rejected.raw


def test_printable_escapes_what_a_terminal_would_act_on_and_caps_the_length() -> None:
    assert printable("a\tb\x1b[2J\u2028\\") == "a\\tb\\x1b[2J\\u2028\\\\"
    assert printable("\n" * 10, limit=5) == "\\n\\n\\"
