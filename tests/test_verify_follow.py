"""Following relaunches in flight: one still pending past `verify.pending_timeout_s` is
cancelled (an action on the record) and counts as no progress, so the planner climbs the ladder
or ends retries; one within it waits on, and a paused or dry-running daemon cancels nothing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.actions import act
from daemon.config import Settings
from daemon.gather import lineage_template
from daemon.pipeline import planner_history
from daemon.planner import Outcome
from daemon.slurm.records import JobState, SlurmJob
from daemon.store.models import Action, ActionResult, Lineage, TemplateRevision
from daemon.store.models import Proposal as ProposalRow
from daemon.store.states import ProposalState
from daemon.verify import FollowDeps, follow_relaunches
from tests.test_actions_store import FakeSlurm, approved_hardware_proposal, deps
from tests.test_pipeline import FakeFiles, failed_job

NOW = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)
TIMEOUT_S = 3600


@dataclass
class QueuedSlurm(FakeSlurm):
    """Accounting shows every relaunch still pending, queued since `queued_since`."""

    queued_since: datetime = NOW
    cancelled: list[int] = dataclasses.field(default_factory=list)

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        self.cancelled.append(int(job_id))

    def job(self, job_id: int | str) -> SlurmJob:
        return dataclasses.replace(
            failed_job(int(job_id)),
            state=JobState.PENDING,
            state_raw=JobState.PENDING.value,
            exit_code=None,
            submit_time=self.queued_since,
            start_time=None,
            end_time=None,
        )


def _relaunched(session: Session, job_id: int) -> ProposalRow:
    """A proposal acted on: its relaunch submitted, now followed."""
    proposal_id = approved_hardware_proposal(session, job_id)
    assert act(session, proposal_id, deps(FakeSlurm())).outcome == "submitted"
    row = session.get(ProposalRow, proposal_id)
    assert row is not None
    assert row.relaunch_job_id is not None
    return row


def _follow(
    session: Session, queued_for: timedelta, slurm: QueuedSlurm | None = None, **policy: bool
) -> list[tuple[int, str]]:
    settings = Settings.model_validate(
        {"verify": {"pending_timeout_s": TIMEOUT_S}, "policy": policy}
    )
    slurm = slurm if slurm is not None else QueuedSlurm()
    slurm.queued_since = NOW - queued_for
    return follow_relaunches(session, FollowDeps(settings, slurm, FakeFiles({}), lambda: NOW))


def test_a_relaunch_pending_past_the_timeout_counts_as_no_progress(db_session: Session) -> None:
    proposal = _relaunched(db_session, 6301)
    slurm = QueuedSlurm()
    late = timedelta(seconds=TIMEOUT_S + 60)
    assert _follow(db_session, late, slurm) == [(proposal.id, "no progress")]
    assert slurm.cancelled == [proposal.relaunch_job_id]  # no second run of the lineage later
    cancel = db_session.scalars(
        select(Action).where(Action.proposal_id == proposal.id, Action.kind == "scancel")
    ).one()
    assert cancel.result == ActionResult.SUCCEEDED.value
    assert cancel.argv == ["scancel", str(proposal.relaunch_job_id)]
    db_session.refresh(proposal)
    assert proposal.state == ProposalState.FAILED.value
    assert proposal.outcome == Outcome.SAME_FAILURE.value
    assert proposal.step_reached == 0  # it ran no step, and resumed from none
    lineage = db_session.get(Lineage, proposal.lineage_id)
    revision = db_session.get(TemplateRevision, proposal.revision_id)
    assert lineage is not None
    assert revision is not None
    dialect = lineage_template(lineage, revision, FakeFiles({})).dialect
    (attempt,) = planner_history(db_session, lineage_id=lineage.id, dialect=dialect).attempts
    assert attempt.failing_step == 2
    assert not attempt.made_progress  # what the planner's max_no_progress counts


def test_a_relaunch_pending_within_the_timeout_waits_on(db_session: Session) -> None:
    proposal = _relaunched(db_session, 6302)
    assert _follow(db_session, timedelta(seconds=TIMEOUT_S - 60)) == [(proposal.id, "PENDING")]
    db_session.refresh(proposal)
    assert proposal.state == ProposalState.SUBMITTED.value
    assert proposal.outcome == Outcome.PENDING.value


@pytest.mark.parametrize("policy", [{"paused": True}, {"dry_run": True}])
def test_a_paused_or_dry_running_daemon_cancels_nothing(
    db_session: Session, policy: dict[str, bool]
) -> None:
    proposal = _relaunched(db_session, 6303)
    slurm = QueuedSlurm()
    (result,) = _follow(db_session, timedelta(seconds=TIMEOUT_S + 60), slurm, **policy)
    assert result[0] == proposal.id
    assert "not cancelled" in result[1]
    assert slurm.cancelled == []
    db_session.refresh(proposal)
    assert proposal.state == ProposalState.SUBMITTED.value
