"""The daemon closing the loop on the real local cluster, with a SQLite record.

A torchrun template whose real run (real-train) plays the `fragmentation` scenario is submitted with
`slurm-medic submit`; it dies; the daemon's cycles diagnose fragmentation, auto-approve
`expandable_segments:True`, relaunch from the last good checkpoint as the owner with the
token in the comment, and verify the relaunch. A true OOM at step 0 (HF dialect) waits in
`proposed` for a person.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from daemon.cli import main
from daemon.config import Settings, load_settings
from daemon.evidence.prober import NodeProber, ProbeSettings
from daemon.gather import OwnerJobFiles
from daemon.service import Daemon
from daemon.slurm.backend import SlurmCli
from daemon.slurm.records import JobState
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import Action, AuditEvent, Incident, Proposal, TemplateRevision
from daemon.store.schema import upgrade
from tests.devcluster import DevCluster
from tests.e2e import REAL_TRAIN

pytestmark = [pytest.mark.cluster]

USER = "alice"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def work_dir() -> Iterator[Path]:
    path = Path(f"/tmp/medic-service-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    shutil.chown(path, USER, USER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_template(
    work_dir: Path,
    example: str,
    scenario: str,
    replace: dict[str, str],
    nccl_timeout_s: int = 3,
    step_seconds: float = 0.05,
    max_steps: int = 12,
) -> Path:
    """The example with this machine's paths, the real run (real-train) playing the scenario,
    and short pacing."""
    target = work_dir / "template"
    shutil.copytree(ROOT / "launch_templates" / example, target)
    toml = (target / "template.toml").read_text()
    checkpoints = str(work_dir / "ckpt")
    for old, new in replace.items():
        toml = toml.replace(old, new)
    # One rank per node, on two nodes: each real rank imports torch (seconds of CPU) and the
    # machine has two cores for every run of the suite.
    toml = toml.replace("ntasks-per-node = 2", "ntasks-per-node = 1")
    toml = toml.replace("gpus_per_node = 2", "gpus_per_node = 1")
    program = json.dumps([str(path) for path in REAL_TRAIN])
    toml = toml.replace('["deploy/devcluster/emulated-train"]', program)
    toml = toml.replace(f'"/tmp/slurm-medic-examples/{example}"', f'"{checkpoints}"')
    toml = toml.replace('output = "%x-%j.out"', f'output = "{work_dir}/%x-%j.out"')
    toml = toml.replace(
        "[env]\n",
        "[env]\n"
        f'EMULATION_SCENARIO = "{scenario}"\n'
        f'EMULATION_STEP_SECONDS = "{step_seconds}"\n'
        f'MAX_STEPS = "{max_steps}"\n'
        f'EMULATION_NCCL_TIMEOUT_SECONDS = "{nccl_timeout_s}"\n',
    )
    (target / "template.toml").write_text(toml)
    return target


def configure(work_dir: Path, cluster: DevCluster, extra: str = "") -> Path:
    config = work_dir / "config.toml"
    config.write_text(
        "[store]\n"
        f'url = "sqlite+pysqlite:///{work_dir}/medic.db"\n'
        "[watcher]\n"
        "poll_interval_s = 1\n"
        "overlap_s = 30\n"
        "initial_lookback_s = 30\n"
        "reconcile_settle_s = 15\n"
        "running_interval_s = 1\n"
        "[verify]\n"
        "margin_steps = 2\n"
        "interval_s = 1\n"
        "[probe]\n"
        f'key_path = "{cluster.medic_key}"\n'
        f'known_hosts_path = "{cluster.known_hosts}"\n'
        f'user = "{cluster.service_user}"\n'
        "cache_ttl_s = 0\n" + extra
    )
    return config


def daemon_for(settings: Settings) -> Daemon:
    engine = make_engine(settings.store)
    upgrade(engine)
    probe = settings.probe
    assert isinstance(probe, ProbeSettings)
    return Daemon(
        settings,
        backend=SlurmCli(),
        files=OwnerJobFiles(),
        prober=NodeProber(probe),
        engine=engine,
    )


def submit(template: Path, config: Path, work_dir: Path) -> int:
    result = CliRunner().invoke(
        main,
        [
            "submit",
            str(template),
            "--as-user",
            USER,
            "--work-dir",
            str(work_dir),
            "--config",
            str(config),
        ],
    )
    assert result.exit_code == 0, result.output
    return int(result.output.split("submitted job ")[1].split()[0])


def cycle_until(daemon: Daemon, done: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = daemon.cycle()
        assert not report.errors, report.errors
        if callable(done) and done():
            return
        time.sleep(1)
    raise AssertionError(f"the loop did not close within {timeout_s} s")


def proposals(daemon: Daemon) -> list[Proposal]:
    with make_session_factory(daemon.engine)() as session:
        return list(session.scalars(select(Proposal).order_by(Proposal.id)))


def test_fragmentation_closes_the_loop_on_its_own(devcluster: DevCluster, work_dir: Path) -> None:
    config = configure(work_dir, devcluster)
    # Slow enough steps that the relaunch is verified while it still runs.
    template = make_template(
        work_dir, "torchrun", "fragmentation", {}, step_seconds=0.3, max_steps=40
    )
    daemon = daemon_for(load_settings(config))
    first_job = submit(template, config, work_dir)
    daemon.start()

    cycle_until(
        daemon,
        lambda: any(p.state == "verified" for p in proposals(daemon)),
        timeout_s=150,
    )
    with make_session_factory(daemon.engine)() as session:
        incident = session.scalars(select(Incident).where(Incident.slurm_job_id == first_job)).one()
        assert incident.kind == "fragmentation"
        proposal = session.scalars(select(Proposal)).one()
        assert proposal.remediator == "allocator_expandable_segments"
        assert proposal.decided_by is None or proposal.decided_by == "slurm-medic"
        action = session.scalars(
            select(Action).where(Action.kind == "sbatch", Action.proposal_id == proposal.id)
        ).one()
        assert action.result == "succeeded"
        assert action.slurm_job_id is not None
        relaunch = SlurmCli().job(action.slurm_job_id)
        revision = session.scalars(
            select(TemplateRevision).where(TemplateRevision.proposal_id == proposal.id)
        ).one()
        assert "export PYTORCH_ALLOC_CONF=expandable_segments:True" in revision.rendered_script
        verifying = session.scalars(
            select(AuditEvent).where(AuditEvent.verb == "proposal_verifying")
        ).one()
    assert verifying.details["reason"] == f"job {action.slurm_job_id} is running"
    assert relaunch.state is JobState.RUNNING  # verified before it ended
    assert relaunch.user == USER
    # 22.05 accounting keeps the comment only once a job ends; slurmctld has it now.
    queued = {job.job_id: job for job in daemon.backend.queued_jobs()}
    assert queued[action.slurm_job_id].comment == action.token
    assert queued[action.slurm_job_id].user == USER
    log = Path(work_dir / f"torchrun-example-{action.slurm_job_id}.out").read_text()
    assert "resumed from checkpoint" in log
    assert "OutOfMemoryError" not in log
    daemon.leader.release()
    SlurmCli().cancel(action.slurm_job_id)  # verified; no need to run it out


def test_true_oom_waits_for_a_person(devcluster: DevCluster, work_dir: Path) -> None:
    config = configure(work_dir, devcluster)
    template = make_template(
        work_dir,
        "torchrun",
        "true-oom-step0",
        {"micro_batch = 4": "micro_batch = 6"},
    )
    daemon = daemon_for(load_settings(config))
    submit(template, config, work_dir)
    daemon.start()
    cycle_until(daemon, lambda: bool(proposals(daemon)), timeout_s=90)
    daemon.cycle()
    waiting = proposals(daemon)
    assert [p.state for p in waiting] == ["proposed"]
    assert waiting[0].remediator == "micro_batch_down"
    assert waiting[0].decided_by is None
    with make_session_factory(daemon.engine)() as session:
        # Nothing acted: the one action is `slurm-medic submit`'s first submission.
        actions = session.scalars(select(Action)).all()
        assert [(action.kind, action.proposal_id) for action in actions] == [("sbatch", None)]
        why = session.scalars(
            select(AuditEvent).where(AuditEvent.verb == "awaiting_approval")
        ).one()
    assert "micro_batch_down is not in policy.auto_approve" in why.details["reasons"]
    daemon.leader.release()


def test_a_wedged_run_is_cancelled_after_the_grace_and_handled_as_failed(
    devcluster: DevCluster, work_dir: Path
) -> None:
    """One rank's OOM while the others hang 120 s in a real gloo allreduce: cancelled after 2 s
    of grace."""
    config = configure(work_dir, devcluster, extra="[wedge]\ngrace_s = 2\n")
    template = make_template(work_dir, "torchrun", "fragmentation", {}, nccl_timeout_s=120)
    daemon = daemon_for(load_settings(config))
    first_job = submit(template, config, work_dir)
    daemon.start()
    started = time.monotonic()
    cycle_until(daemon, lambda: bool(proposals(daemon)), timeout_s=90)
    assert time.monotonic() - started < 120  # well before gloo's timeout would have ended it
    with make_session_factory(daemon.engine)() as session:
        cancelled = session.scalars(
            select(AuditEvent).where(AuditEvent.verb == "wedged_cancelled")
        ).one()
        incident = session.scalars(select(Incident)).one()
        scancel = session.scalars(select(Action).where(Action.kind == "scancel")).one()
    assert cancelled.subject_id == str(first_job)
    assert incident.slurm_job_id == first_job
    assert incident.kind == "fragmentation"
    assert scancel.result == "succeeded"
    assert SlurmCli().job(first_job).state is JobState.CANCELLED
    cycle_until(
        daemon, lambda: any(p.state == "verified" for p in proposals(daemon)), timeout_s=120
    )
    daemon.leader.release()
