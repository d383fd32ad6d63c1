"""Every SlurmCli operation against the real local Slurm 22.05 cluster (deploy/devcluster)."""

from __future__ import annotations

import os
import pwd
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from daemon import process
from daemon.process import CommandResult
from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import JobNotFound, NodeNotFound, OperationRefused, SlurmUnavailable
from daemon.slurm.records import JobState, PathSource, SlurmJob
from tests.devcluster import user_dir

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("devcluster")]

USER = "alice"
SPARE_NODE = "gpu-04"


class CountingSeam:
    """The real seam, counting how often each program is run."""

    def __init__(self) -> None:
        self.argvs: list[tuple[str, ...]] = []

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
        self.argvs.append(tuple(argv))
        return process.run(
            argv, timeout=timeout, check=check, input_text=input_text, env=env, cwd=cwd
        )

    def count(self, program: str) -> int:
        return sum(1 for argv in self.argvs if _command(argv) == program)


def _command(argv: tuple[str, ...] | list[str]) -> str:
    """The program a call runs: sbatch for a user runs behind `setpriv ... --`."""
    return argv[argv.index("--") + 1] if argv[0] == "setpriv" else argv[0]


@pytest.fixture
def work_dir() -> Iterator[str]:
    """A directory alice can write her job logs into (pytest's tmp_path is root-only)."""
    with user_dir("medic-slurm-test", USER) as path:
        yield str(path)


@pytest.fixture
def cli() -> SlurmCli:
    return SlurmCli(timeout_s=30, attempts=3, backoff_s=0.5)


def _job_soon(cli: SlurmCli, job_id: int | str) -> SlurmJob | None:
    """Accounting learns of a job a moment after sbatch answers."""
    try:
        return cli.job(job_id)
    except JobNotFound:
        return None


def _wait_finished(cli: SlurmCli, job_id: int | str, limit_s: float = 90) -> SlurmJob:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        job = _job_soon(cli, job_id)
        # A job that ends within moments of starting can be read from slurmdbd's placeholder
        # record until the real one lands: wait for that, and for two equal reads.
        if job is not None and job.state.is_terminal() and job.accounting_complete:
            time.sleep(1.0)
            again = cli.job(job_id)
            if (again.nodes, again.steps) == (job.nodes, job.steps):
                return again
            continue
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish within {limit_s}s")


def _wait_running(cli: SlurmCli, job_id: int, limit_s: float = 60) -> SlurmJob:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        job = _job_soon(cli, job_id)
        if job is not None and job.state is JobState.RUNNING:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not start within {limit_s}s")


def _scontrol(*args: str) -> None:
    process.run(["scontrol", *args], timeout=30, check=True)


def test_submit_as_alice_with_a_hostile_comment(cli: SlurmCli, work_dir: str) -> None:
    marker = Path(f"/tmp/medic-pwned-{uuid.uuid4().hex[:8]}")
    # "\udcff" is the byte 0xff as os.fsencode passes it; accounting stores it as "?".
    comment = (
        f"tok-{uuid.uuid4().hex[:6]} $(touch {marker}) `touch {marker}` \"q\" 'q'; x\nline2 \udcff"
    )
    seam = CountingSeam()
    submitting = SlurmCli(runner=seam)
    job_id = submitting.submit(
        "#!/bin/bash\necho hello from $SLURMD_NODENAME\nexit 0\n",
        as_user=USER,
        comment=comment,
        work_dir=work_dir,
        extra_args=["--job-name=hostile-comment", "--output=%x-%j.out"],
    )
    assert seam.count("sbatch") == 1
    job = _wait_finished(cli, job_id)
    assert job.user == USER
    assert job.uid == pwd.getpwnam(USER).pw_uid or job.uid is None
    assert job.comment == comment.replace("\udcff", "?")
    assert job.state is JobState.COMPLETED
    assert job.exit_code == 0
    assert not marker.exists()
    log = Path(work_dir) / f"hostile-comment-{job_id}.out"
    assert log.read_text().startswith("hello from gpu-")
    assert log.stat().st_uid == pwd.getpwnam(USER).pw_uid


def test_exclude_nodes_is_honoured(cli: SlurmCli, work_dir: str) -> None:
    job_id = cli.submit(
        "#!/bin/bash\nsrun true\n",
        as_user=USER,
        exclude_nodes=["gpu-02"],
        work_dir=work_dir,
        extra_args=["--nodes=3", "--output=/dev/null"],
    )
    job = _wait_finished(cli, job_id)
    assert len(job.nodes) == 3
    assert "gpu-02" not in job.nodes


def test_failing_four_node_job_reads_back_fully(cli: SlurmCli, work_dir: str) -> None:
    script = "#!/bin/bash\nsrun bash -c '[ \"$SLURM_PROCID\" = 2 ] && exit 1; exit 0'\n"
    job_id = cli.submit(
        script,
        as_user=USER,
        work_dir=work_dir,
        extra_args=["--nodes=4", "--ntasks-per-node=1", "--job-name=four", "--output=%x-%j.out"],
    )
    running_or_done = _job_soon(cli, job_id)
    job = _wait_finished(cli, job_id)
    assert job.state is JobState.FAILED
    assert job.nodes == ("gpu-01", "gpu-02", "gpu-03", "gpu-04")
    assert job.batch_host == "gpu-01"
    # 22.05's JSON hides the 1; job() fills it from --parsable2.
    assert (job.exit_code, job.exit_signal) == (1, 0)
    assert [step.step_id for step in job.steps] == ["batch", "0"]
    assert job.steps[1].exit_code == 1
    if running_or_done and running_or_done.std_paths_source is PathSource.CONTROLLER:
        assert running_or_done.stdout_path == f"{work_dir}/four-{job_id}.out"


def test_std_paths_come_from_the_controller_while_it_knows_the_job(
    cli: SlurmCli, work_dir: str
) -> None:
    job_id = cli.submit(
        "#!/bin/bash\nsleep 30\n",
        as_user=USER,
        work_dir=work_dir,
        extra_args=["--job-name=paths", "--output=%x-%j.log"],
    )
    try:
        job = _wait_running(cli, job_id)
        assert job.std_paths_source is PathSource.CONTROLLER
        assert job.stdout_path == f"{work_dir}/paths-{job_id}.log"
        running = cli.running_jobs(users=[USER])
        assert job_id in {running_job.job_id for running_job in running}
        assert all(running_job.state is JobState.RUNNING for running_job in running)
    finally:
        cli.cancel(job_id)


def test_cancel(cli: SlurmCli, work_dir: str) -> None:
    job_id = cli.submit(
        "#!/bin/bash\nsrun sleep 300\n",
        as_user=USER,
        work_dir=work_dir,
        extra_args=["--output=/dev/null"],
    )
    _wait_running(cli, job_id)
    cli.cancel(job_id)
    job = _wait_finished(cli, job_id)
    assert job.state is JobState.CANCELLED
    assert job.killed_by == "root"


def test_finished_jobs_is_one_sacct_call_for_many_jobs(cli: SlurmCli, work_dir: str) -> None:
    since = datetime.now(UTC) - timedelta(seconds=5)
    ids = [
        cli.submit(
            f"#!/bin/bash\nexit {code}\n",
            as_user=USER,
            work_dir=work_dir,
            extra_args=["--output=/dev/null"],
        )
        for code in (1, 2, 3, 4, 5, 6)
    ]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        done = {
            job.job_id
            for job in cli.finished_jobs(since, datetime.now(UTC) + timedelta(seconds=5))
            if job.accounting_complete
        }
        if set(ids) <= done:
            break
        time.sleep(0.5)
    seam = CountingSeam()
    counted = SlurmCli(runner=seam)
    jobs = counted.finished_jobs(since, datetime.now(UTC) + timedelta(seconds=5))
    assert seam.count("sacct") == 1
    assert len(seam.argvs) == 1
    found = {job.job_id: job for job in jobs}
    assert set(ids) <= set(found)
    assert all(found[job_id].state is JobState.FAILED for job_id in ids)
    assert all(found[job_id].steps for job_id in ids)


def test_parsable2_fallback_reads_the_same_jobs(cli: SlurmCli, work_dir: str) -> None:
    since = datetime.now(UTC) - timedelta(seconds=5)
    job_id = cli.submit(
        "#!/bin/bash\nsrun true\nexit 9\n",
        as_user=USER,
        work_dir=work_dir,
        extra_args=["--nodes=2", "--job-name=fallback name", "--output=/dev/null"],
    )
    from_json = _wait_finished(cli, job_id)
    window = (since, datetime.now(UTC) + timedelta(seconds=5))
    fallback = SlurmCli(json_output=False)
    (from_text,) = [job for job in fallback.finished_jobs(*window) if job.job_id == job_id]
    assert (from_text.exit_code, from_text.exit_signal) == (9, 0)
    assert (from_json.exit_code, from_json.exit_signal) == (9, 0)
    for field in ("name", "user", "state", "nodes", "batch_host", "start_time", "end_time"):
        assert getattr(from_text, field) == getattr(from_json, field), field
    assert [s.step_id for s in from_text.steps] == [s.step_id for s in from_json.steps]


def test_array_tasks_and_het_components(cli: SlurmCli, work_dir: str) -> None:
    array_id = cli.submit(
        '#!/bin/bash\n[ "$SLURM_ARRAY_TASK_ID" = 1 ] && exit 3\nexit 0\n',
        as_user=USER,
        work_dir=work_dir,
        extra_args=["--array=0-2", "--output=/dev/null"],
    )
    het_id = cli.submit(
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH hetjob\n#SBATCH --nodes=1\n"
        "srun --het-group=0,1 true\n",
        as_user=USER,
        work_dir=work_dir,
        extra_args=["--output=/dev/null"],
    )
    failed_task = _wait_finished(cli, f"{array_id}_1")
    assert (failed_task.array_job_id, failed_task.array_task_id) == (array_id, 1)
    assert (failed_task.state, failed_task.exit_code) == (JobState.FAILED, 3)
    second = _wait_finished(cli, f"{het_id}+1")
    assert (second.het_job_id, second.het_job_offset) == (het_id, 1)
    assert second.state is JobState.COMPLETED
    assert second.display_id == f"{het_id}+1"


def test_drain_resume_and_the_medic_rule(cli: SlurmCli) -> None:
    reason = f"medic: test drain {uuid.uuid4().hex[:6]}"
    try:
        cli.drain(SPARE_NODE, reason)
        node = cli.node(SPARE_NODE)
        assert node.is_drained
        assert node.drained_by_medic
        assert node.reason == reason
        assert node.reason_user == "root"
        assert node.reason_time is not None
        cli.resume(SPARE_NODE)
        assert not cli.node(SPARE_NODE).is_drained
    finally:
        _restore(SPARE_NODE)


def test_someone_elses_drain_is_never_cleared_or_overwritten(cli: SlurmCli) -> None:
    reason = f"ops: disk check {uuid.uuid4().hex[:6]}"
    try:
        _scontrol("update", f"NodeName={SPARE_NODE}", "State=DRAIN", f"Reason={reason}")
        with pytest.raises(OperationRefused):
            cli.resume(SPARE_NODE)
        with pytest.raises(OperationRefused):
            cli.drain(SPARE_NODE, "medic: xid 79")
        node = cli.node(SPARE_NODE)
        assert node.is_drained
        assert node.reason == reason
    finally:
        _restore(SPARE_NODE)


def _restore(name: str) -> None:
    result = process.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], timeout=30)
    assert result.ok or "Invalid node state" in result.stderr


def test_nodes_lists_the_cluster(cli: SlurmCli) -> None:
    names = [node.name for node in cli.nodes()]
    assert {"gpu-01", "gpu-02", "gpu-03", "gpu-04"} <= set(names)
    assert cli.node("gpu-02").address == "10.77.0.12"


def test_a_node_slurmctld_does_not_know_is_node_not_found(cli: SlurmCli) -> None:
    """scontrol's answer comes on stdout with exit 1; the backend reads it there."""
    with pytest.raises(NodeNotFound, match="nosuchnode"):
        cli.node("nosuchnode")


def test_the_accounting_backlog_is_read_from_the_real_sdiag() -> None:
    """What slurmctld holds for slurmdbd: a few messages while jobs start and end (the suite's
    other tests), drained to 0 within seconds while slurmdbd answers (the outage tests see
    it grow while slurmdbd is stopped)."""
    deadline = time.monotonic() + 60
    seen = [SlurmCli().accounting_backlog()]
    while seen[-1] != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        seen.append(SlurmCli().accounting_backlog())
    assert seen[-1] == 0, seen


def test_dead_controller_and_slurmdbd_give_slurm_unavailable_in_bounded_time(
    tmp_path: Path,
) -> None:
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text()
    dead = [_dead_line(line) for line in conf.splitlines()]
    dead_conf = tmp_path / "slurm.conf"
    dead_conf.write_text("\n".join(dead) + "\n")
    env = {**os.environ, "SLURM_CONF": str(dead_conf)}
    cli = SlurmCli(env=env, timeout_s=8, attempts=2, backoff_s=0.2)
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable) as nodes_error:
        cli.nodes()
    assert time.monotonic() - started < 2 * 8 + 0.2 + 5
    assert nodes_error.value.attempts == 2
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable):
        cli.finished_jobs(datetime.now(UTC) - timedelta(hours=1), datetime.now(UTC))
    assert time.monotonic() - started < 2 * 8 + 0.2 + 5
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable):
        cli.accounting_backlog()
    assert time.monotonic() - started < 2 * 8 + 0.2 + 5


def _dead_line(line: str) -> str:
    """Point the controller at an address nobody answers on, and both ports at port 1."""
    if line.startswith("SlurmctldHost="):
        return "SlurmctldHost=" + line.split("=", 1)[1].partition("(")[0] + "(10.77.0.250)"
    if line.startswith(("SlurmctldPort=", "AccountingStoragePort=")):
        return line.split("=", 1)[0] + "=1"
    if line.startswith("MessageTimeout="):
        return "MessageTimeout=2"
    return line
