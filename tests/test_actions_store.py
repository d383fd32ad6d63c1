"""Acting on an approved proposal with the record (both databases) and Slurm faked at its seam:
drains within the breaker, exclusion always, pause and dry run hold, and a lost or refused
sbatch answer leaves the record exactly where reconciliation or a person needs it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.actions import ActDeps, act
from daemon.config import Settings
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence
from daemon.gather import lineage_template
from daemon.pipeline import DAEMON
from daemon.planner import LineageHistory, PlannerPolicy, Proposal, plan, planned_fix
from daemon.slurm.errors import JobNotFound, SubmissionError
from daemon.slurm.records import JobState, JobWindow, QueuedJob, SlurmJob, SlurmNode
from daemon.store import action_rows, control
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import Action, Lineage, NodeEvent, TemplateRevision
from daemon.store.models import Proposal as ProposalRow
from daemon.store.states import ProposalState
from tests.test_pipeline import FakeFiles, failed_job, start_lineage

HARDWARE = Diagnosis(
    FailureKind.HARDWARE,
    Confidence.HIGH,
    ("XID 79 on gpu-03",),
    node="gpu-03",
    step=2,
    bad_nodes=("gpu-03",),
    probe_confirmed=True,  # the probe saw the XID: only then is a node drained
)


@dataclass
class FakeSlurm:
    """The Slurm seam: records what the daemon asked; `submit_error` makes sbatch fail."""

    submit_error: SubmissionError | None = None
    submitted: list[dict[str, object]] = field(default_factory=list)
    drained: list[tuple[str, str]] = field(default_factory=list)

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> tuple[SlurmJob, ...]:
        return ()

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> JobWindow:
        return JobWindow(self.finished_jobs(since, until, states))

    def running_jobs(self, *, users: Iterable[str] = ()) -> tuple[SlurmJob, ...]:
        return ()

    def job(self, job_id: int | str) -> SlurmJob:
        raise JobNotFound(f"accounting has no job {job_id}")

    def jobs(self, job_ids: Iterable[int]) -> tuple[SlurmJob, ...]:
        """`job` for each id, as SlurmCli's batch answers: an unknown id is left out."""
        found = []
        for job_id in job_ids:
            try:
                found.append(self.job(job_id))
            except JobNotFound:
                continue
        return tuple(found)

    def queued_jobs(self) -> tuple[QueuedJob, ...]:
        return ()

    def accounting_backlog(self) -> int:
        return 0

    def submit(
        self,
        script: str,
        *,
        as_user: str,
        comment: str | None = None,
        exclude_nodes: Iterable[str] = (),
        extra_args: Sequence[str] = (),
        work_dir: str | None = None,
    ) -> int:
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(
            {"script": script, "user": as_user, "comment": comment, "exclude": tuple(exclude_nodes)}
        )
        return 7000 + len(self.submitted)

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        raise AssertionError("not asked for in these tests")

    def drain(self, node: str, reason: str) -> None:
        self.drained.append((node, reason))

    def resume(self, node: str) -> None:
        raise AssertionError("not asked for in these tests")

    def node(self, name: str) -> SlurmNode:
        raise AssertionError("not asked for in these tests")

    def nodes(self) -> tuple[SlurmNode, ...]:
        return ()


def approved_hardware_proposal(session: Session, job_id: int) -> int:
    lineage_id = start_lineage(session, job_id)
    repo.record_job(session, job=failed_job(job_id), lineage_id=lineage_id, attempt=1)
    incident = repo.record_incident(
        session, slurm_job_id=job_id, evidence=Evidence(), diagnosis=HARDWARE
    )
    lineage = session.get(Lineage, lineage_id)
    submission = records.lineage_submission(
        session, slurm_job_id=job_id, user="alice", comment=None
    )
    assert lineage is not None
    assert submission is not None
    revision = session.get(TemplateRevision, submission.revision_id)
    assert revision is not None
    template = lineage_template(lineage, revision, FakeFiles({}))
    planned = plan(HARDWARE, template, LineageHistory(), PlannerPolicy())
    assert isinstance(planned, Proposal)
    assert planned.remediation.remediator == "drain_and_exclude"
    row = repo.propose(
        session,
        incident_id=incident.id,
        fix=planned_fix(planned, template.knobs, 2),
        rationale=planned.remediation.rationale,
        cost=0.0,
        changes_science=False,
        actor=DAEMON,
    )
    repo.transition_proposal(session, proposal_id=row.id, to=ProposalState.APPROVED, actor=DAEMON)
    return row.id


def deps(slurm: FakeSlurm, **policy: object) -> ActDeps:
    settings = Settings.model_validate({"policy": policy})
    return ActDeps(settings=settings, backend=slurm, files=FakeFiles({}))


def state_of(session: Session, proposal_id: int) -> str:
    row = session.get(ProposalRow, proposal_id)
    assert row is not None
    return row.state


def test_drain_then_relaunch_excluding_the_node(db_session: Session) -> None:
    proposal_id = approved_hardware_proposal(db_session, 6001)
    slurm = FakeSlurm()
    result = act(db_session, proposal_id, deps(slurm))
    assert result.outcome == "submitted"
    assert [node for node, _ in slurm.drained] == ["gpu-03"]
    assert slurm.drained[0][1].startswith("medic: ")
    (submitted,) = slurm.submitted
    assert submitted["exclude"] == ("gpu-03",)
    assert submitted["user"] == "alice"
    assert str(submitted["comment"]).startswith("medic-")
    assert "#SBATCH --exclude=gpu-03" in str(submitted["script"])
    assert state_of(db_session, proposal_id) == ProposalState.SUBMITTED.value
    events = db_session.scalars(select(NodeEvent)).all()
    assert [(e.node, e.kind, e.by_medic) for e in events] == [("gpu-03", "drain", True)]


def test_the_breaker_skips_the_drain_but_still_excludes(db_session: Session) -> None:
    proposal_id = approved_hardware_proposal(db_session, 6101)
    slurm = FakeSlurm()
    result = act(db_session, proposal_id, deps(slurm, max_drains_per_hour=0))
    assert result.outcome == "submitted"
    assert slurm.drained == []
    assert slurm.submitted[0]["exclude"] == ("gpu-03",)


@pytest.mark.parametrize("hold", ["paused", "dry_run"])
def test_pause_and_dry_run_touch_nothing(db_session: Session, hold: str) -> None:
    proposal_id = approved_hardware_proposal(db_session, 6201)
    slurm = FakeSlurm()
    if hold == "paused":
        control.set_paused(db_session, paused=True, actor=DAEMON, reason="test")
        result = act(
            db_session,
            proposal_id,
            ActDeps(
                settings=Settings(),
                backend=slurm,
                files=FakeFiles({}),
                paused=lambda: control.is_paused(db_session),
            ),
        )
    else:
        result = act(db_session, proposal_id, deps(slurm, dry_run=True))
    assert result.outcome == "held"
    assert (slurm.drained, slurm.submitted) == ([], [])
    assert state_of(db_session, proposal_id) == ProposalState.APPROVED.value


def test_a_refused_sbatch_fails_the_proposal_with_its_words(db_session: Session) -> None:
    proposal_id = approved_hardware_proposal(db_session, 6301)
    refused = SubmissionError(
        "sbatch refused the job", argv=["sbatch"], returncode=1, stderr="Invalid account"
    )
    result = act(db_session, proposal_id, deps(FakeSlurm(submit_error=refused)))
    assert result.outcome == "failed"
    assert state_of(db_session, proposal_id) == ProposalState.FAILED.value
    action = db_session.scalars(
        select(Action).where(Action.kind == "sbatch", Action.proposal_id == proposal_id)
    ).one()
    assert action.result == "failed"
    assert action.stderr == "Invalid account"


def test_a_lost_answer_leaves_the_intent_for_reconciliation(db_session: Session) -> None:
    proposal_id = approved_hardware_proposal(db_session, 6401)
    lost = SubmissionError(
        "sbatch timed out; the job may exist",
        argv=["sbatch"],
        returncode=None,
        stderr="",
        maybe_submitted=True,
    )
    result = act(db_session, proposal_id, deps(FakeSlurm(submit_error=lost)))
    assert result.outcome == "maybe_submitted"
    assert state_of(db_session, proposal_id) == ProposalState.SUBMITTING.value
    (intent,) = action_rows.pending_intents(db_session)
    assert intent.proposal_id == proposal_id
