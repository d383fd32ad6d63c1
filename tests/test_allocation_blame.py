"""Only nodes of the job's allocation are probed or blamed: a node that a log line names
outside it (`srun: error: gpu-09: ...` from a job that ran on gpu-01) is suspicious text, in
the pipeline, the wedge check and `slurm-medic diagnose JOBID` alike."""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from daemon.cli import main
from daemon.commands import diagnose as diagnose_command
from daemon.config import Settings
from daemon.evidence.findings import OUTSIDE_ALLOCATION, confine_to_allocation
from daemon.evidence.joblog import scan_log
from daemon.evidence.prober import NodeProber, ProbeSettings, RawProbe
from daemon.evidence.records import LogFindings
from daemon.owner_files import OwnerFiles, TemplateTexts
from daemon.pipeline import PipelineDeps, handle_ended_job
from daemon.service import Daemon
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import repository as repo
from daemon.store.engine import make_session_factory
from daemon.store.models import AuditEvent, Incident
from daemon.store.models import Proposal as ProposalRow
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings
from tests.test_actions_store import FakeSlurm
from tests.test_pipeline import T0, FakeFiles, failed_job, start_lineage
from tests.test_probe import document, tool

# A one-rank job on gpu-01 whose log blames gpu-09 in srun's words; its OOM numbers say
# fragmentation (6.84 GiB reserved but unallocated for a 3.00 GiB request).
REPRODUCER = (
    "0: step 1 loss 2.01\n"
    "0: step 2 loss 2.02\n"
    "0: Traceback (most recent call last):\n"
    '0:   File "train.py", line 10, in <module>\n'
    "0:     loss.backward()\n"
    "0: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a"
    " total capacity of 79.19 GiB of which 1.66 GiB is free. Including non-PyTorch memory,"
    " this process has 77.50 GiB memory in use. Of the allocated memory 70.09 GiB is allocated"
    " by PyTorch, and 6.84 GiB is reserved by PyTorch but unallocated. If reserved but"
    " unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    " to avoid fragmentation.\n"
    "srun: error: gpu-09: task 0: Exited with exit code 1\n"
)
XID_79 = (T0 - timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00") + (
    " NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus.\n"
)


def on_gpu_01(job: SlurmJob) -> SlurmJob:
    return dataclasses.replace(job, nodes=("gpu-01",), batch_host="gpu-01")


class LogText(FakeFiles):
    """The owner's reader, faked: every job's log is `text`, scanned by the real scanner."""

    def __init__(self, text: str) -> None:
        super().__init__({})
        self.text = text

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        return scan_log(io.BytesIO(self.text.encode()))

    def read_template(self, owner: str, directory: str) -> TemplateTexts:
        return OwnerFiles.as_caller().read_template(directory)


class NodeStates:
    """Probe documents per node (gpu-09 has fallen off the bus); counts what was fetched."""

    def __init__(self) -> None:
        self.fetched: list[str] = []

    def __call__(self, node: str) -> RawProbe:
        self.fetched.append(node)
        kernel = XID_79 if node == "gpu-09" else ""
        return RawProbe(node, T0, document(kernel_log=tool(kernel)))


@pytest.fixture
def prober_settings(tmp_path: Path) -> ProbeSettings:
    (tmp_path / "key").write_text("k")
    (tmp_path / "known_hosts").write_text("")
    return ProbeSettings(key_path=tmp_path / "key", known_hosts_path=tmp_path / "known_hosts")


def test_the_gpu_09_reproducer_neither_probes_nor_drains_gpu_09(
    db_session: Session, prober_settings: ProbeSettings
) -> None:
    start_lineage(db_session, 6001)
    states = NodeStates()
    deps = PipelineDeps(
        settings=Settings(),
        prober=NodeProber(prober_settings, fetch=states, clock=lambda: T0),
        files=LogText(REPRODUCER),
    )
    result = handle_ended_job(db_session, on_gpu_01(failed_job(6001)), deps)
    assert states.fetched == ["gpu-01"]
    proposals = db_session.scalars(select(ProposalRow)).all()
    assert [row.remediator for row in proposals] == ["allocator_expandable_segments"]
    assert result.approved
    assert all(action.node != "gpu-09" for action in repo.attempt_record(proposals[0]).fix.actions)
    incident = db_session.scalars(select(Incident).where(Incident.slurm_job_id == 6001)).one()
    evidence, verdict = repo.incident_records(incident)
    note = f"{OUTSIDE_ALLOCATION}: 'gpu-09' (the job ran on gpu-01); not probed or blamed"
    assert (incident.kind, incident.node) == ("fragmentation", "gpu-01")
    assert evidence.log.notes[-1] == note
    assert [r for r in verdict.reasons if r.startswith(OUTSIDE_ALLOCATION)] == [note]


def test_a_node_of_the_allocation_named_by_the_log_is_still_the_one_probed(
    db_session: Session, prober_settings: ProbeSettings
) -> None:
    start_lineage(db_session, 6002)
    states = NodeStates()
    deps = PipelineDeps(
        settings=Settings(),
        prober=NodeProber(prober_settings, fetch=states, clock=lambda: T0),
        files=LogText(REPRODUCER),
    )
    job = dataclasses.replace(failed_job(6002), nodes=("gpu-01", "gpu-09"), batch_host="gpu-01")
    handle_ended_job(db_session, job, deps)
    assert states.fetched == ["gpu-09"]
    (proposal,) = db_session.scalars(select(ProposalRow)).all()
    assert proposal.remediator == "drain_and_exclude"
    assert [action.node for action in repo.attempt_record(proposal).fix.actions] == ["gpu-09"]


FINDINGS = LogFindings(rank=0, node="gpu-09", step=2, notes=("an earlier note",))


def test_a_node_outside_the_allocation_becomes_a_note() -> None:
    confined = confine_to_allocation(FINDINGS, on_gpu_01(failed_job(1)))
    assert confined.node is None
    assert (confined.rank, confined.step) == (0, 2)
    assert confined.notes == (
        "an earlier note",
        f"{OUTSIDE_ALLOCATION}: 'gpu-09' (the job ran on gpu-01); not probed or blamed",
    )


def test_nodes_of_the_allocation_and_its_batch_host_are_kept() -> None:
    batch_host_only = dataclasses.replace(failed_job(1), nodes=("gpu-08",), batch_host="gpu-09")
    assert confine_to_allocation(FINDINGS, batch_host_only) is FINDINGS
    many = dataclasses.replace(failed_job(1), nodes=("gpu-01", "gpu-09"), batch_host="gpu-01")
    assert confine_to_allocation(FINDINGS, many) is FINDINGS
    nameless = dataclasses.replace(FINDINGS, node=None)
    assert confine_to_allocation(nameless, on_gpu_01(failed_job(1))) is nameless


def test_a_job_whose_allocation_slurm_did_not_report_trusts_no_node_of_the_log() -> None:
    unknown = dataclasses.replace(failed_job(1), nodes=(), batch_host=None)
    confined = confine_to_allocation(FINDINGS, unknown)
    assert confined.node is None
    assert confined.notes[-1] == (
        f"{OUTSIDE_ALLOCATION}: 'gpu-09' (the job ran on nodes Slurm did not report);"
        " not probed or blamed"
    )


def test_an_odd_node_name_in_the_note_is_quoted_and_cut() -> None:
    odd = dataclasses.replace(FINDINGS, node="gpu-\x1b[2J" + "x" * 200)
    note = confine_to_allocation(odd, on_gpu_01(failed_job(1))).notes[-1]
    assert "\x1b" not in note
    assert "'gpu-\\x1b[2J" + "x" * 56 + "' (the job" in note  # 64 characters kept


# ------------------------------------------------------------------------------ wedge


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    upgrade(empty_db_engine)
    return empty_db_engine


class RunningSlurm(FakeSlurm):
    """One lineage job still running on gpu-01; cancelling it is recorded."""

    def __init__(self, job: SlurmJob) -> None:
        super().__init__()
        self.running = job
        self.cancelled: list[int] = []

    def running_jobs(self, *, users: object = ()) -> tuple[SlurmJob, ...]:
        return (self.running,)

    def job(self, job_id: int | str) -> SlurmJob:
        return self.running

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        self.cancelled.append(int(job_id))


def test_the_wedge_check_records_the_node_outside_the_allocation(fresh_engine: Engine) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 6101)
        session.commit()
    running = dataclasses.replace(
        on_gpu_01(failed_job(6101)), state=JobState.RUNNING, state_raw="RUNNING", end_time=None
    )
    slurm = RunningSlurm(running)
    url = fresh_engine.url.render_as_string(hide_password=False)
    settings = Settings.model_validate({"store": StoreSettings(url=url), "wedge": {"grace_s": 0}})
    now = T0 + timedelta(minutes=1)
    daemon = Daemon(
        settings, backend=slurm, files=LogText(REPRODUCER), engine=fresh_engine, clock=lambda: now
    )
    report = daemon.cycle()
    daemon.leader.release()
    assert report.wedged_cancelled == [6101]
    with make_session_factory(fresh_engine)() as session:
        event = session.scalars(
            select(AuditEvent).where(AuditEvent.verb == "wedged_cancelled")
        ).one()
    assert event.details["notes"] == [
        f"{OUTSIDE_ALLOCATION}: 'gpu-09' (the job ran on gpu-01); not probed or blamed"
    ]


def test_a_dry_running_daemon_never_cancels_a_wedged_run(fresh_engine: Engine) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 6102)
        session.commit()
    running = dataclasses.replace(
        on_gpu_01(failed_job(6102)), state=JobState.RUNNING, state_raw="RUNNING", end_time=None
    )
    slurm = RunningSlurm(running)
    url = fresh_engine.url.render_as_string(hide_password=False)
    settings = Settings.model_validate(
        {"store": StoreSettings(url=url), "wedge": {"grace_s": 0}, "policy": {"dry_run": True}}
    )
    now = T0 + timedelta(minutes=1)
    daemon = Daemon(
        settings, backend=slurm, files=LogText(REPRODUCER), engine=fresh_engine, clock=lambda: now
    )
    report = daemon.cycle()
    daemon.leader.release()
    assert report.wedged_cancelled == []
    assert slurm.cancelled == []


# -------------------------------------------------------------------- diagnose JOBID


def test_diagnose_jobid_names_the_allocations_node_and_reports_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "job-6201.out"
    log.write_text(REPRODUCER)
    job = dataclasses.replace(on_gpu_01(failed_job(6201)), stdout_path=str(log))
    monkeypatch.setattr(diagnose_command, "_job", lambda _context, _job_id: job)
    result = CliRunner().invoke(main, ["diagnose", "6201", "--json"])
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.output)
    assert verdict["node"] == "gpu-01"
    assert verdict["kind"] == "fragmentation"
    assert verdict["bad_nodes"] == []
    assert (
        f"{OUTSIDE_ALLOCATION}: 'gpu-09' (the job ran on gpu-01); not probed or blamed"
        in (verdict["reasons"])
    )


def test_diagnose_from_a_log_alone_knows_no_allocation_and_keeps_the_logs_node(
    tmp_path: Path,
) -> None:
    log = tmp_path / "job.out"
    log.write_text(REPRODUCER)
    result = CliRunner().invoke(main, ["diagnose", "--log", str(log), "--json"])
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.output)
    assert verdict["node"] == "gpu-09"
    assert not any(reason.startswith(OUTSIDE_ALLOCATION) for reason in verdict["reasons"])
