"""One exactly-once protocol for every submission: `slurm-medic submit`'s first job and the
daemon's relaunch are both an intent row committed before sbatch, closed by sbatch's answer
or, after a crash, by one reconciliation that looks for the token (both databases)."""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.pipeline import DAEMON, handle_ended_job
from daemon.process import CommandResult
from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import SubmissionError
from daemon.slurm.records import QueuedJob
from daemon.slurm.sbatch import submitter_ids
from daemon.store import action_rows
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import Action, AuditEvent, Lineage, LineageStatus
from daemon.submission import Sbatch, reconcile, submit_new_lineage, submit_once
from tests.test_actions_store import FakeSlurm
from tests.test_pipeline import FRAGMENTED, deps, failed_job, start_lineage

ALICE = repo.Actor.user("alice", 1001)
SCRIPT = "#!/bin/bash\ntorchrun train.py\n"
SETTLE = timedelta(seconds=60)
REFUSED = SubmissionError(
    "sbatch refused the job", argv=["sbatch"], returncode=1, stderr="Invalid account"
)
LOST = SubmissionError(
    "sbatch timed out", argv=["sbatch"], returncode=None, stderr="", maybe_submitted=True
)


class QueueSlurm(FakeSlurm):
    """FakeSlurm whose queue shows `queue` (job id, user, comment)."""

    def __init__(self, queue: tuple[QueuedJob, ...] = (), **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.queue = queue

    def queued_jobs(self) -> tuple[QueuedJob, ...]:
        return self.queue


def first_submission(session: Session, slurm: FakeSlurm) -> tuple[int, action_rows.SubmitIntent]:
    started = submit_new_lineage(
        session,
        slurm,
        Sbatch(SCRIPT, "alice", "/home/alice"),
        name="clm",
        template_dir="/home/alice/templates/clm",
        knobs={"micro_batch": 8},
        actor=ALICE,
    )
    return started.lineage_id, started.outcome.intent


def audit_verbs(session: Session, subject_type: str, subject_id: object) -> list[str]:
    return list(
        session.scalars(
            select(AuditEvent.verb)
            .where(
                AuditEvent.subject_type == subject_type,
                AuditEvent.subject_id == str(subject_id),
            )
            .order_by(AuditEvent.id)
        )
    )


def test_a_first_submission_is_a_row_of_its_lineage(db_session: Session) -> None:
    slurm = FakeSlurm()
    lineage_id, intent = first_submission(db_session, slurm)
    assert slurm.submitted[0]["comment"] == intent.token
    assert slurm.submitted[0]["script"] == SCRIPT
    assert intent.revision_id is not None
    found = records.lineage_submission(db_session, slurm_job_id=7001, user="alice", comment=None)
    assert found == records.LineageSubmission(
        7001, lineage_id, 1, intent.revision_id, None, intent.token
    )
    assert records.lineage_job_ids(db_session) == {7001: lineage_id}
    lineage = db_session.get(Lineage, lineage_id)
    assert lineage is not None
    assert lineage.attempts == 1
    assert audit_verbs(db_session, "action", intent.action_id) == ["submit_intent", "submitted"]
    assert audit_verbs(db_session, "job", 7001) == ["lineage_submit"]
    # A first submission counts against no relaunch budget.
    since = datetime.now(UTC) - timedelta(hours=1)
    assert records.relaunches_since(db_session, since=since, owner="alice") == 0


def test_a_refused_first_submission_closes_its_intent_with_sbatchs_words(
    db_session: Session,
) -> None:
    started = submit_new_lineage(
        db_session,
        FakeSlurm(submit_error=REFUSED),
        Sbatch(SCRIPT, "alice", None),
        name="clm",
        template_dir="/t",
        knobs={},
        actor=ALICE,
    )
    assert started.outcome.error is REFUSED
    action = db_session.get(Action, started.outcome.intent.action_id)
    assert action is not None
    assert (action.result, action.stderr, action.slurm_job_id) == (
        "failed",
        "Invalid account",
        None,
    )
    assert action_rows.pending_intents(db_session) == []
    assert records.lineage_job_ids(db_session, active_only=False) == {}
    assert audit_verbs(db_session, "action", action.id) == ["submit_intent", "submit_failed"]


def test_a_lost_first_answer_is_found_once_settled_and_only_then(db_session: Session) -> None:
    lineage_id, intent = first_submission(db_session, FakeSlurm(submit_error=LOST))
    assert action_rows.pending_intents(db_session) == [intent]
    slurm = QueueSlurm((QueuedJob(8101, "alice", intent.token),))
    young = intent.recorded_at + timedelta(seconds=5)
    # The CLI may still be between sbatch and its own record: not looked for yet.
    assert reconcile(db_session, slurm, now=young, settle=SETTLE, actor=DAEMON) == []
    assert action_rows.pending_intents(db_session) == [intent]
    settled = intent.recorded_at + 2 * SETTLE
    (closed,) = reconcile(db_session, slurm, now=settled, settle=SETTLE, actor=DAEMON)
    assert (closed.action_id, closed.lineage_id, closed.proposal_id, closed.job_id) == (
        intent.action_id,
        lineage_id,
        None,
        8101,
    )
    found = records.lineage_submission(db_session, slurm_job_id=8101, user="alice", comment=None)
    assert found is not None
    assert (found.lineage_id, found.attempt, found.token) == (lineage_id, 1, intent.token)
    assert audit_verbs(db_session, "action", intent.action_id)[-1] == "reconciled_found"


def test_one_reconciliation_closes_relaunches_and_first_submissions_alike(
    db_session: Session,
) -> None:
    relaunched_lineage = start_lineage(db_session, 9001)
    handled = handle_ended_job(db_session, failed_job(9001), deps({9001: FRAGMENTED}))
    assert handled.proposal_id is not None
    revision = repo.record_template_revision(
        db_session,
        lineage_id=relaunched_lineage,
        knobs={},
        rendered_script=SCRIPT,
        proposal_id=handled.proposal_id,
    )
    relaunch = submit_once(
        db_session,
        FakeSlurm(submit_error=LOST),
        Sbatch(SCRIPT, "alice", None),
        actor=DAEMON,
        proposal_id=handled.proposal_id,
        revision_id=revision.id,
    ).intent
    first_lineage, first = first_submission(db_session, FakeSlurm(submit_error=LOST))
    slurm = QueueSlurm((QueuedJob(9002, "alice", relaunch.token),))
    young = first.recorded_at + timedelta(seconds=5)
    (closed,) = reconcile(db_session, slurm, now=young, settle=SETTLE, actor=DAEMON)
    assert (closed.proposal_id, closed.job_id) == (handled.proposal_id, 9002)
    assert relaunch.attempt == 2
    found = records.lineage_submission(db_session, slurm_job_id=9002, user="alice", comment=None)
    assert found is not None
    assert (found.lineage_id, found.attempt, found.revision_id, found.proposal_id) == (
        relaunched_lineage,
        2,
        revision.id,
        handled.proposal_id,
    )
    assert action_rows.pending_intents(db_session) == [first]

    settled = first.recorded_at + 2 * SETTLE
    (gone,) = reconcile(db_session, slurm, now=settled, settle=SETTLE, actor=DAEMON)
    assert (gone.lineage_id, gone.job_id) == (first_lineage, None)
    action = db_session.get(Action, first.action_id)
    assert action is not None
    assert action.result == "not_found"
    lineage = db_session.get(Lineage, first_lineage)
    assert lineage is not None
    assert lineage.attempts == 0


def test_an_inactive_lineages_jobs_are_left_out_unless_asked_for(db_session: Session) -> None:
    lineage_id, _intent = first_submission(db_session, FakeSlurm())
    repo.set_lineage_status(
        db_session,
        lineage_id=lineage_id,
        status=LineageStatus.ABANDONED,
        actor=ALICE,
        reason="done",
    )
    assert records.lineage_job_ids(db_session) == {}
    assert records.lineage_job_ids(db_session, active_only=False) == {7001: lineage_id}


@pytest.mark.root
def test_the_recorded_sbatch_argv_is_the_one_that_ran(db_session: Session) -> None:
    """The intent's argv and the runner's argv are one: as root, sbatch behind setpriv and
    no `--uid`; the owner here is root itself, so no user of the host is needed."""
    ran: list[tuple[str, ...]] = []

    def runner(argv: Sequence[str], **_: object) -> CommandResult:
        ran.append(tuple(argv))
        return CommandResult(tuple(argv), 0, "4242\n", "", 0.01)

    cli = SlurmCli(runner=runner, euid=os.geteuid())
    started = submit_new_lineage(
        db_session,
        cli,
        Sbatch(SCRIPT, "root", "/root", exclude=("gpu-03",)),
        name="clm",
        template_dir="/root/templates/clm",
        knobs={"micro_batch": 8},
        actor=ALICE,
    )
    assert started.outcome.job_id == 4242
    action = db_session.get(Action, started.outcome.intent.action_id)
    assert action is not None
    assert ran == [tuple(action.argv)]
    assert not any(arg.startswith(("--uid", "--gid")) for arg in action.argv)
    assert action.argv[: action.argv.index("--") + 2] == [
        "setpriv",
        "--reuid=0",
        "--regid=0",
        "--init-groups",
        "--no-new-privs",
        "--",
        "sbatch",
    ]


def test_only_root_names_the_owner_in_the_argv() -> None:
    owner = pwd.getpwuid(0)
    assert submitter_ids(owner, 0) == (0, 0)
    assert submitter_ids(owner, 1001) == (None, None)
