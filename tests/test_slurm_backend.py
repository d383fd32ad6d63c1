"""SlurmCli's logic with the seam faked: retries, refusals, argv it builds, fallbacks.

The same operations run against the real cluster in test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from daemon.process import CommandResult, CommandTimeout
from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import (
    JobNotFound,
    NodeNotFound,
    OperationRefused,
    SlurmCommandError,
    SlurmParseError,
    SlurmUnavailable,
    SubmissionError,
)
from daemon.slurm.records import RAW_CHARS, JobState, PathSource, QueuedJob, printable
from daemon.slurm.sacct_json import parse_sacct_json

REAL = Path(__file__).parent / "data" / "slurm" / "dbv0.0.38"
Answer = Callable[[tuple[str, ...]], CommandResult]


def _text(name: str) -> str:
    return (REAL / name).read_bytes().decode("utf-8", errors="replace")


def _result(argv: tuple[str, ...], code: int = 0, out: str = "", err: str = "") -> CommandResult:
    return CommandResult(argv=argv, returncode=code, stdout=out, stderr=err, duration_s=0.01)


@dataclass
class FakeSeam:
    """Answers each call from `answers` in order; records argv and stdin."""

    answers: list[Answer]
    calls: list[tuple[str, ...]] = field(default_factory=list)
    stdin: list[str | None] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        self.calls.append(tuple(argv))
        self.stdin.append(input_text)
        return self.answers.pop(0)(tuple(argv))


def _ok(out: str) -> Answer:
    return lambda argv: _result(argv, out=out)


def _fail(code: int, err: str) -> Answer:
    return lambda argv: _result(argv, code=code, err=err)


def _hang(argv: tuple[str, ...]) -> CommandResult:
    raise CommandTimeout("timed out after 1s", argv=argv)


def _cli(seam: FakeSeam, sleeps: list[float] | None = None, euid: int = 0) -> SlurmCli:
    record = sleeps if sleeps is not None else []
    return SlurmCli(
        runner=seam, attempts=3, backoff_s=0.5, sleep=record.append, euid=euid, local_tz=UTC
    )


WINDOW = (datetime(2026, 11, 22, 3, 0, tzinfo=UTC), datetime(2026, 11, 22, 4, 0, tzinfo=UTC))


def test_finished_jobs_is_one_sacct_call_with_the_window_and_states() -> None:
    seam = FakeSeam([_ok(_text("array.json"))])
    jobs = _cli(seam).finished_jobs(*WINDOW, states=[JobState.FAILED])
    assert [job.display_id for job in jobs] == ["9_1"]
    assert seam.calls == [
        (
            "sacct",
            "--json",
            "--allusers",
            "--starttime",
            "2026-11-22T03:00:00",
            "--endtime",
            "2026-11-22T04:00:00",
            "--state",
            "FAILED",
        )
    ]


def test_unavailable_controller_is_retried_with_backoff_then_a_clear_error() -> None:
    down = "sacct: error: Problem talking to the database: Connection refused"
    seam = FakeSeam([_fail(1, down), _hang, _fail(1, down)])
    sleeps: list[float] = []
    with pytest.raises(SlurmUnavailable) as caught:
        _cli(seam, sleeps).finished_jobs(*WINDOW)
    assert len(seam.calls) == 3
    assert sleeps == [0.5, 1.0]
    assert caught.value.attempts == 3
    assert "Connection refused" in caught.value.last_error


def test_a_retry_that_succeeds_returns_the_jobs() -> None:
    seam = FakeSeam([_hang, _ok(_text("failed.json"))])
    assert [job.job_id for job in _cli(seam).finished_jobs(*WINDOW)] == [5]


def test_other_failures_are_not_retried_and_carry_context() -> None:
    seam = FakeSeam([_fail(1, "sacct: fatal: Invalid user: nobody-here")])
    with pytest.raises(SlurmCommandError) as caught:
        _cli(seam).finished_jobs(*WINDOW)
    assert len(seam.calls) == 1
    assert caught.value.returncode == 1
    assert caught.value.argv[0] == "sacct"
    assert "Invalid user" in caught.value.stderr


def test_without_json_the_parsable2_fallback_is_used_and_remembered() -> None:
    no_json = "sacct: unrecognized option '--json'"
    seam = FakeSeam(
        [_fail(1, no_json), _ok(_text("failed.parsable2")), _ok(_text("failed.parsable2"))]
    )
    cli = _cli(seam)
    assert [(j.job_id, j.exit_code) for j in cli.finished_jobs(*WINDOW)] == [(5, 1)]
    cli.finished_jobs(*WINDOW)
    assert [call[1] for call in seam.calls] == ["--json", "--parsable2", "--parsable2"]


def test_job_on_22_05_fills_exit_codes_and_std_paths() -> None:
    seam = FakeSeam(
        [
            _ok(_text("failed.json")),
            _ok(_text("failed.parsable2")),
            _ok(_text("scontrol-show-job-failed.txt")),
        ]
    )
    job = _cli(seam).job(5)
    assert (job.exit_code, job.derived_exit_code) == (1, 1)
    assert job.stdout_path == "/tmp/medic-samples/train-4node-5.out"
    assert job.std_paths_source is PathSource.CONTROLLER
    assert [call[:3] for call in seam.calls] == [
        ("sacct", "--json", "--jobs"),
        ("sacct", "--parsable2", "--noheader"),
        ("scontrol", "--oneliner", "show"),
    ]


def test_job_forgotten_by_slurmctld_says_paths_unknown() -> None:
    seam = FakeSeam(
        [
            _ok(_text("failed.json")),
            _ok(_text("failed.parsable2")),
            _fail(1, "slurm_load_jobs error: Invalid job id specified"),
        ]
    )
    job = _cli(seam).job("5")
    assert job.stdout_path is None
    assert job.std_paths_source is PathSource.UNKNOWN


def test_unknown_job() -> None:
    empty = '{"meta": {"plugin": {"type": "openapi/dbv0.0.38"}}, "errors": [], "jobs": []}'
    with pytest.raises(JobNotFound):
        _cli(FakeSeam([_ok(empty)])).job(99)


@pytest.mark.parametrize("bad", ["-u alice", "5;rm", "", "5 6", "--all"])
def test_job_ids_that_could_be_options_never_reach_argv(bad: str) -> None:
    seam = FakeSeam([])
    with pytest.raises(ValueError, match="job id"):
        _cli(seam).job(bad)
    with pytest.raises(ValueError, match="job id"):
        _cli(seam).cancel(bad)
    assert seam.calls == []


def test_submit_as_root_runs_sbatch_as_the_owner_and_passes_comment_whole() -> None:
    """No `--uid` from root: sbatch is the owner's own process (their uid, gid and groups, no
    new privileges), so slurmctld grants the script's `#SBATCH` lines only the owner's rights."""
    entry = pwd.getpwuid(os.geteuid())
    comment = "tok $(touch /tmp/x) `id` \"q\" 'q'\nline2"
    seam = FakeSeam([_ok("77\n")])
    job_id = _cli(seam).submit(
        "#!/bin/bash\nsrun true\n",
        as_user=entry.pw_name,
        comment=comment,
        exclude_nodes=["gpu-03", "gpu-01", "gpu-02"],
        extra_args=["--nodes=4"],
        work_dir="/home/alice",
    )
    assert job_id == 77
    assert seam.calls == [
        (
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--init-groups",
            "--no-new-privs",
            "--",
            "sbatch",
            "--parsable",
            "--chdir=/home/alice",
            f"--comment={comment}",
            "--exclude=gpu-[01-03]",
            "--nodes=4",
        )
    ]
    assert seam.stdin == ["#!/bin/bash\nsrun true\n"]


def test_submit_as_someone_else_without_root_is_refused() -> None:
    other = next(entry for entry in pwd.getpwall() if entry.pw_uid != 12345)
    seam = FakeSeam([])
    with pytest.raises(SubmissionError, match="without root"):
        _cli(seam, euid=12345).submit("#!/bin/bash\n", as_user=other.pw_name)
    assert seam.calls == []


def test_submit_failures_are_submission_errors_and_never_retried() -> None:
    user = pwd.getpwuid(os.geteuid()).pw_name
    refused = FakeSeam([_fail(1, "sbatch: error: Batch job submission failed: Invalid account")])
    with pytest.raises(SubmissionError) as caught:
        _cli(refused).submit("#!/bin/bash\n", as_user=user)
    assert not caught.value.maybe_submitted
    assert caught.value.returncode == 1
    assert len(refused.calls) == 1
    lost = FakeSeam([_hang])
    with pytest.raises(SubmissionError) as timed_out:
        _cli(lost).submit("#!/bin/bash\n", as_user=user)
    assert timed_out.value.maybe_submitted
    assert len(lost.calls) == 1


@pytest.mark.parametrize("args", [["--time", "5"], ["job.sh"], ["--wrap"]])
def test_extra_args_must_be_option_value_pairs(args: list[str]) -> None:
    user = pwd.getpwuid(os.geteuid()).pw_name
    with pytest.raises(SubmissionError, match="--option=value"):
        _cli(FakeSeam([])).submit("#!/bin/bash\n", as_user=user, extra_args=args)


def _node_line(state: str, reason: str | None) -> str:
    line = _text("scontrol-show-node-drained.txt")
    line = line.replace("State=IDLE+DRAIN", f"State={state}")
    head = line.split(" Reason=")[0]
    return head + (f" Reason={reason} [ops@2026-11-22T03:00:00]" if reason else "") + "\n"


def test_an_unknown_node_is_node_not_found_where_scontrol_says_so_on_stdout() -> None:
    """Every release prints "Node nosuchnode not found" on stdout and exits 1 (seen on the
    local cluster's 22.05); stderr is empty."""
    seam = FakeSeam([lambda argv: _result(argv, code=1, out="Node nosuchnode not found\n")])
    with pytest.raises(NodeNotFound, match="nosuchnode"):
        _cli(seam).node("nosuchnode")
    assert len(seam.calls) == 1


def test_another_failure_of_show_node_is_a_command_error_with_its_words() -> None:
    seam = FakeSeam([lambda argv: _result(argv, code=1, out="slurm_load_node: Zero Bytes\n")])
    with pytest.raises(SlurmCommandError, match="Zero Bytes") as raised:
        _cli(seam).node("gpu-03")
    assert not isinstance(raised.value, NodeNotFound)


def test_resume_refuses_a_drain_someone_else_set() -> None:
    seam = FakeSeam([_ok(_node_line("IDLE+DRAIN", "disk failing, do not touch"))])
    with pytest.raises(OperationRefused, match="not set by slurm-medic"):
        _cli(seam).resume("gpu-03")
    assert len(seam.calls) == 1


def test_resume_of_a_medic_drain_runs_scontrol_update() -> None:
    seam = FakeSeam([_ok(_node_line("IDLE+DRAIN", "medic: xid 79")), _ok("")])
    _cli(seam).resume("gpu-03")
    assert seam.calls[1] == ("scontrol", "update", "NodeName=gpu-03", "State=RESUME")


def test_drain_never_overwrites_another_reason() -> None:
    seam = FakeSeam([_ok(_node_line("IDLE+DRAIN", "ops maintenance"))])
    with pytest.raises(OperationRefused, match="does not overwrite"):
        _cli(seam).drain("gpu-03", "medic: xid 79")
    assert len(seam.calls) == 1


def test_drain_reason_rules() -> None:
    seam = FakeSeam([_ok(_node_line("IDLE", None)), _ok("")])
    cli = _cli(seam)
    with pytest.raises(ValueError, match="medic:"):
        cli.drain("gpu-03", "xid 79")
    with pytest.raises(ValueError, match="printable"):
        cli.drain("gpu-03", "medic: two\nlines")
    with pytest.raises(ValueError, match="node name"):
        cli.drain("-gpu-03", "medic: x")
    cli.drain("gpu-03", "medic: xid 79 on GPU 3")
    assert seam.calls[-1] == (
        "scontrol",
        "update",
        "NodeName=gpu-03",
        "State=DRAIN",
        "Reason=medic: xid 79 on GPU 3",
    )


def test_cancel_with_a_signal() -> None:
    seam = FakeSeam([_ok(""), _ok("")])
    cli = _cli(seam)
    cli.cancel(12)
    cli.cancel("9_1", signal="USR1")
    assert seam.calls == [("scancel", "12"), ("scancel", "--signal=USR1", "--full", "9_1")]
    with pytest.raises(ValueError, match="signal"):
        cli.cancel(12, signal="KILL; rm -rf /")


def test_a_script_that_is_not_text_is_refused_before_sbatch() -> None:
    user = pwd.getpwuid(os.geteuid()).pw_name
    seam = FakeSeam([])
    with pytest.raises(SubmissionError, match="not UTF-8"):
        _cli(seam).submit("#!/bin/bash\necho \udcff\n", as_user=user)
    assert seam.calls == []


def _array_with_an_unreadable_task() -> str:
    """The real array job, with task 9_1 (job 16) ending past any time a record can hold."""
    document = json.loads(_text("array.json"))
    (task,) = [job for job in document["jobs"] if job["job_id"] == 16]
    task["time"]["end"] = 10**19
    return json.dumps(document)


def test_a_poll_keeps_the_readable_jobs_and_logs_the_one_it_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seam = FakeSeam([_ok(_array_with_an_unreadable_task())])
    with caplog.at_level(logging.WARNING, logger="daemon.slurm.backend"):
        jobs = _cli(seam).finished_jobs(*WINDOW, states=[JobState.COMPLETED, JobState.FAILED])
    assert sorted(job.display_id for job in jobs) == ["9_0", "9_2"]
    assert "left out a record of sacct --json (dbv0.0.38) (16)" in caplog.text
    assert "time.end" in caplog.text


def test_a_job_whose_record_cannot_be_read_is_a_parse_error_not_an_unknown_job() -> None:
    with pytest.raises(SlurmParseError, match=r"time\.end"):
        _cli(FakeSeam([_ok(_array_with_an_unreadable_task())])).job(16)


def test_jobs_asks_for_many_ids_in_one_sacct_call_and_one_parsable2_call() -> None:
    """The poll's batch: the real array document answers for 15 and 16, 99 is unknown."""
    seam = FakeSeam(
        [
            _ok(_text("array.json")),
            _ok(_text("array.parsable2")),
            _fail(1, "slurm_load_jobs error: Invalid job id specified"),
            _fail(1, "slurm_load_jobs error: Invalid job id specified"),
        ]
    )
    jobs = _cli(seam).jobs([16, 15, 99, 16])
    assert [job.display_id for job in jobs] == ["9_1", "9_0"]
    assert [job.exit_code for job in jobs] == [3, 0]  # from --parsable2: the JSON hides them
    assert seam.calls[0][1:] == ("--json", "--jobs", "16,15,99")
    assert seam.calls[1][1] == "--parsable2"
    # only the FAILED task: a COMPLETED one's JSON exit code is believed
    assert seam.calls[1][-2:] == ("--jobs", "16")
    assert [call[:5] for call in seam.calls[2:]] == [
        ("scontrol", "--oneliner", "show", "job", "16"),
        ("scontrol", "--oneliner", "show", "job", "15"),
    ]


def test_jobs_of_an_unreadable_record_leaves_it_out_and_asks_nothing_for_none() -> None:
    seam = FakeSeam([_ok(_array_with_an_unreadable_task())])
    assert _cli(seam).jobs([16]) == ()
    assert len(seam.calls) == 1
    assert _cli(seam).jobs([]) == ()
    assert len(seam.calls) == 1


def test_a_window_of_only_unreadable_records_is_an_answer_with_their_text() -> None:
    document = json.loads(_text("failed.json"))
    document["jobs"][0]["time"]["end"] = 10**19
    seam = FakeSeam([_ok(json.dumps(document))])
    window = _cli(seam).finished_window(*WINDOW)
    assert window.jobs == ()
    (rejected,) = window.rejected
    assert rejected.record_id == "5"
    whole = json.dumps(document["jobs"][0])
    assert (rejected.raw, rejected.raw_chars) == (printable(whole), len(whole))
    assert len(rejected.raw) == RAW_CHARS < len(whole)
    with pytest.raises(SlurmParseError, match="no job could be read"):
        parse_sacct_json(json.dumps(document))  # the parser alone still says so


def test_the_queue_is_read_through_the_seam_with_retries() -> None:
    down = "squeue: error: Unable to contact slurm controller (connect failure)"
    queue = {"jobs": [{"job_id": 41, "user_name": "alice", "comment": "medic-0a1b"}]}
    seam = FakeSeam([_fail(1, down), _ok(json.dumps(queue))])
    assert _cli(seam).queued_jobs() == (QueuedJob(41, "alice", "medic-0a1b"),)
    assert seam.calls == [("squeue", "--json", "--all", "--states=all")] * 2


def test_the_accounting_backlog_is_one_sdiag_call_retried_while_slurmctld_is_away() -> None:
    stopped = _text("sdiag-slurmdbd-stopped.txt")
    sleeps: list[float] = []
    seam = FakeSeam(
        [
            _fail(1, "sdiag: error: Unable to contact slurm controller (connect failure)"),
            _ok(stopped),
        ]
    )
    assert _cli(seam, sleeps).accounting_backlog() == 3
    assert seam.calls == [("sdiag",), ("sdiag",)]
    assert sleeps == [0.5]
