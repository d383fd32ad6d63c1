"""The pipeline on a real record (SQLite and PostgreSQL), its file reads faked at the seam:
a failed lineage job becomes an incident, a proposal and a policy decision; a relaunch that
fails the same way climbs the ladder; one that fails differently stops for a person."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.actions import validated_patch
from daemon.checkpoints import Checkpoint, CheckpointLayout, CheckpointScan, CheckpointSpec
from daemon.config import Settings
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence, LogFindings, OomFamily, OomReport, Phase
from daemon.gather import with_template_paths
from daemon.owner_files import OwnerFiles, TemplateTexts
from daemon.pipeline import PipelineDeps, failing_step, handle_ended_job
from daemon.planner import LineageHistory, PlannedFix, PlannerPolicy, Proposal, plan, planned_fix
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import action_rows
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.codec import from_json, to_json
from daemon.store.models import AuditEvent, Lineage
from daemon.store.models import Proposal as ProposalRow
from daemon.store.states import ProposalState
from daemon.templates.reading import load_template
from daemon.templates.revisions import initial_revision, knobs_to_json

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = ROOT / "launch_templates" / "torchrun"
GIB = 1024**3
T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
ACTOR = repo.Actor.user("alice", 1001)


def oom(requested: float, free: float, allocated: float, unallocated: float) -> OomReport:
    return OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message="torch.OutOfMemoryError: CUDA out of memory.",
        requested_bytes=int(requested * GIB),
        total_bytes=int(79.19 * GIB),
        free_bytes=int(free * GIB),
        allocated_bytes=int(allocated * GIB),
        reserved_bytes=int((allocated + unallocated) * GIB),
        reserved_unallocated_bytes=int(unallocated * GIB),
    )


FRAGMENTED = LogFindings(
    rank=3,
    node="gpu-04",
    step=4,
    max_step_seen=4,
    phase=Phase.FORWARD,
    oom=oom(1.54, 0.54, 64.73, 13.42),
    traceback_seen=True,
)
HOST_KILLED = LogFindings(
    rank=3,
    node="gpu-04",
    step=2,
    max_step_seen=2,
    root_failure_line="srun: error: gpu-04: task 3: Killed",
    exit_code=137,
    killed_by_signal=9,
)


class FakeFiles:
    """The seam that reads a job's files as its owner, answering from tables."""

    def __init__(
        self, logs: dict[int, LogFindings], checkpoints: dict[int, Checkpoint] | None = None
    ) -> None:
        self.logs = logs
        self.checkpoints = checkpoints or {}
        self.paths_read: list[str] = []

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        self.paths_read.append(path)
        return self.logs[job.job_id]

    def find_last_good(self, job: SlurmJob, spec: CheckpointSpec) -> CheckpointScan:
        found = self.checkpoints.get(job.job_id)
        return CheckpointScan(spec.root, found, (), "" if found else "none in this test")

    def read_template(self, owner: str, directory: str) -> TemplateTexts:
        return OwnerFiles.as_caller().read_template(directory)  # the test's own rights


def failed_job(job_id: int, *, end: datetime = T0, state: JobState = JobState.FAILED) -> SlurmJob:
    return SlurmJob(
        job_id=job_id,
        name="torchrun-example",
        user="alice",
        uid=1001,
        group="alice",
        account="training",
        partition="gpu",
        state=state,
        state_raw=state.value,
        exit_code=1,
        exit_signal=None,
        derived_exit_code=None,
        derived_exit_signal=None,
        nodes=("gpu-01", "gpu-02", "gpu-03", "gpu-04"),
        batch_host="gpu-01",
        submit_time=end - timedelta(minutes=5),
        start_time=end - timedelta(minutes=4),
        end_time=end,
        stdout_path=f"/home/alice/torchrun-example-{job_id}.out",
        stderr_path=None,
        work_dir="/home/alice",
        comment=None,
    )


def start_lineage(session: Session, job_id: int) -> int:
    template = load_template(TEMPLATE_DIR)
    first = initial_revision(template)
    lineage = repo.create_lineage(
        session, name=template.name, owner="alice", template=str(TEMPLATE_DIR)
    )
    revision = repo.record_template_revision(
        session,
        lineage_id=lineage.id,
        knobs=knobs_to_json(first.knobs),
        rendered_script=first.script,
    )
    intent = action_rows.record_submit_intent(
        session,
        lineage_id=lineage.id,
        revision_id=revision.id,
        build_argv=lambda token: ["sbatch", f"--comment={token}"],
        actor=ACTOR,
    )
    action_rows.record_submitted(session, intent=intent, slurm_job_id=job_id, actor=ACTOR)
    return lineage.id


def deps(logs: dict[int, LogFindings]) -> PipelineDeps:
    return PipelineDeps(settings=Settings(), prober=None, files=FakeFiles(logs))


def pretend_relaunched(session: Session, proposal_id: int, job_id: int, lineage_id: int) -> None:
    """What `actions.act` leaves behind, without Slurm: revision, closed intent, submission."""
    proposal = session.get(ProposalRow, proposal_id)
    assert proposal is not None
    revision = repo.record_template_revision(
        session,
        lineage_id=lineage_id,
        knobs=knobs_to_json(repo.attempt_record(proposal).fix.knobs_after),
        rendered_script="#!/bin/bash\n",
        proposal_id=proposal_id,
    )
    repo.record_relaunch_revision(
        session, proposal=proposal, revision_id=revision.id, resumed_step=None
    )
    intent = action_rows.record_submit_intent(
        session,
        proposal_id=proposal_id,
        build_argv=lambda token: ["sbatch", f"--comment={token}"],
        actor=ACTOR,
    )
    action_rows.record_submitted(session, intent=intent, slurm_job_id=job_id, actor=ACTOR)


def test_fragmentation_is_proposed_and_auto_approved(db_session: Session) -> None:
    lineage_id = start_lineage(db_session, 5001)
    result = handle_ended_job(db_session, failed_job(5001), deps({5001: FRAGMENTED}))
    assert result.outcome == "proposed"
    assert result.approved
    proposal = db_session.get(ProposalRow, result.proposal_id)
    assert proposal is not None
    assert proposal.remediator == "allocator_expandable_segments"
    assert proposal.state == ProposalState.APPROVED.value
    assert proposal.lineage_id == lineage_id
    assert proposal.failing_step == 4
    assert records.handled_job_ids(db_session, slurm_job_ids=[5001, 5002]) == {5001}


def test_a_job_of_no_lineage_is_not_touched(db_session: Session) -> None:
    result = handle_ended_job(db_session, failed_job(5101), deps({5101: FRAGMENTED}))
    assert result.outcome == "unmanaged"
    assert db_session.scalars(select(AuditEvent).where(AuditEvent.subject_id == "5101")).all() == []


def test_a_managed_account_is_diagnosed_but_never_proposed(db_session: Session) -> None:
    settings = Settings.model_validate({"managed": {"accounts": ["training"]}})
    files = FakeFiles({5201: FRAGMENTED})
    result = handle_ended_job(
        db_session, failed_job(5201), PipelineDeps(settings=settings, prober=None, files=files)
    )
    assert result.outcome == "diagnosed"
    assert result.proposal_id is None


def test_the_same_failure_again_climbs_the_ladder(db_session: Session) -> None:
    lineage_id = start_lineage(db_session, 5301)
    first = handle_ended_job(db_session, failed_job(5301), deps({5301: FRAGMENTED}))
    assert first.proposal_id is not None
    pretend_relaunched(db_session, first.proposal_id, 5302, lineage_id)
    again = handle_ended_job(
        db_session,
        failed_job(5302, end=T0 + timedelta(minutes=10)),
        deps({5302: FRAGMENTED}),
    )
    tried = db_session.get(ProposalRow, first.proposal_id)
    assert tried is not None
    assert tried.state == ProposalState.FAILED.value
    assert tried.outcome == "same_failure"
    assert again.outcome == "proposed"
    # The relaunch ran with expandable_segments:True, so the same stranded bytes no longer
    # explain the failure (issue 11's rule): a true OOM, whose ladder starts at the batch.
    assert again.detail == "micro_batch_down"


def test_a_different_failure_stops_and_asks_a_person(db_session: Session) -> None:
    lineage_id = start_lineage(db_session, 5401)
    first = handle_ended_job(db_session, failed_job(5401), deps({5401: FRAGMENTED}))
    assert first.proposal_id is not None
    pretend_relaunched(db_session, first.proposal_id, 5402, lineage_id)
    again = handle_ended_job(
        db_session,
        failed_job(5402, end=T0 + timedelta(minutes=10), state=JobState.OUT_OF_MEMORY),
        deps({5402: HOST_KILLED}),
    )
    assert again.outcome == "refused"
    assert "failed differently" in again.detail
    lineage = db_session.get(Lineage, lineage_id)
    assert lineage is not None
    assert lineage.status == "exhausted"


def test_a_proposal_round_trips_through_its_row() -> None:
    template = load_template(TEMPLATE_DIR)
    diagnosis = Diagnosis(FailureKind.FRAGMENTATION, Confidence.HIGH, ("t",), step=4)
    outcome = plan(diagnosis, template, LineageHistory(), PlannerPolicy())
    assert isinstance(outcome, Proposal)
    stored = from_json(PlannedFix, to_json(planned_fix(outcome, template.knobs, 4)))
    assert validated_patch(template.dialect, stored.patch) == outcome.patch


def test_a_relaunch_whose_submission_event_was_lost_is_still_the_lineages(
    db_session: Session,
) -> None:
    """A crash between closing the intent and writing `lineage_submit` loses only the event."""
    lineage_id = start_lineage(db_session, 5501)
    first = handle_ended_job(db_session, failed_job(5501), deps({5501: FRAGMENTED}))
    assert first.proposal_id is not None
    proposal = db_session.get(ProposalRow, first.proposal_id)
    assert proposal is not None
    revision = repo.record_template_revision(
        db_session,
        lineage_id=lineage_id,
        knobs=knobs_to_json(repo.attempt_record(proposal).fix.knobs_after),
        rendered_script="#!/bin/bash\n",
        proposal_id=proposal.id,
    )
    intent = action_rows.record_submit_intent(
        db_session,
        proposal_id=proposal.id,
        build_argv=lambda token: ["sbatch", f"--comment={token}"],
        actor=ACTOR,
    )
    action_rows.record_submitted(db_session, intent=intent, slurm_job_id=5502, actor=ACTOR)
    assert records.lineage_job_ids(db_session)[5502] == lineage_id
    found = records.lineage_submission(db_session, slurm_job_id=5502, user="alice", comment=None)
    assert found is not None
    assert (found.lineage_id, found.revision_id, found.proposal_id) == (
        lineage_id,
        revision.id,
        proposal.id,
    )
    assert found.token == intent.token


def test_the_failing_step_is_the_furthest_the_dead_run_logged() -> None:
    evidence = Evidence(log=dataclasses.replace(FRAGMENTED, step=2, max_step_seen=5))
    verdict = Diagnosis(FailureKind.FRAGMENTATION, Confidence.HIGH, ("t",), step=2)
    assert failing_step(verdict, evidence) == 5
    assert failing_step(dataclasses.replace(verdict, step=None), Evidence()) is None


def test_a_lineage_jobs_log_is_found_from_its_template_when_slurm_forgot_it(
    db_session: Session,
) -> None:
    start_lineage(db_session, 5601)
    job = dataclasses.replace(failed_job(5601), stdout_path=None, stderr_path=None)
    submission = records.lineage_submission(
        db_session, slurm_job_id=5601, user="alice", comment=None
    )
    assert submission is not None
    found = with_template_paths(db_session, job, submission, FakeFiles({}))
    assert found.stdout_path == "/home/alice/torchrun-example-5601.out"
    assert found.stderr_path is None


def test_a_completed_relaunch_slurm_forgot_is_judged_from_its_templates_log(
    db_session: Session,
) -> None:
    """Handled after MinJobAge, a relaunch that ran to the end has no log path in 22.05
    accounting; its revision's sbatch options give it, so it is verified, not 'no progress'."""
    lineage_id = start_lineage(db_session, 5701)
    first = handle_ended_job(db_session, failed_job(5701), deps({5701: FRAGMENTED}))
    assert first.proposal_id is not None
    pretend_relaunched(db_session, first.proposal_id, 5702, lineage_id)
    forgotten = dataclasses.replace(
        failed_job(5702, end=T0 + timedelta(minutes=10), state=JobState.COMPLETED),
        exit_code=0,
        stdout_path=None,
    )
    passed = dataclasses.replace(FRAGMENTED, step=None, max_step_seen=12, oom=None)
    checkpoint = Checkpoint(CheckpointLayout.GLOB, Path("/ckpt/step_12"), 12, "/ckpt/step_12")
    files = FakeFiles({5702: passed}, {5702: checkpoint})
    result = handle_ended_job(
        db_session, forgotten, PipelineDeps(settings=Settings(), prober=None, files=files)
    )
    assert files.paths_read == ["/home/alice/torchrun-example-5702.out"]
    assert (result.outcome, result.detail) == ("completed", "verified")
    proposal = db_session.get(ProposalRow, first.proposal_id)
    assert proposal is not None
    assert proposal.state == ProposalState.VERIFIED.value
