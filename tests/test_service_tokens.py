"""Reconciliation finds a relaunch or a first submission by its token only on a job of the
lineage's owner, and only when the token is a whole field of the comment: a token copied
into another user's job, in slurmctld's queue or in accounting, is ignored and noted."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, select

from daemon.pipeline import DAEMON, handle_ended_job
from daemon.process import CommandResult
from daemon.slurm.backend import SlurmCli
from daemon.slurm.records import JobState, QueuedJob, SlurmJob
from daemon.store import action_rows
from daemon.store import repository as repo
from daemon.store.engine import make_session_factory
from daemon.store.models import AuditEvent, Lineage, Proposal
from daemon.store.schema import upgrade
from daemon.store.service_records import carries_token
from daemon.submission import (
    VERB_FOREIGN_TOKEN,
    Sbatch,
    reconcile,
    submit_new_lineage,
)
from daemon.templates.reading import load_template
from daemon.templates.revisions import initial_revision, knobs_to_json
from tests.devcluster import user_dir
from tests.test_actions_store import FakeSlurm
from tests.test_pipeline import FRAGMENTED, TEMPLATE_DIR, deps, failed_job, start_lineage

SETTLE = timedelta(seconds=60)  # the reconcile settle time by default
SETTLED = timedelta(minutes=2)  # past it


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    upgrade(empty_db_engine)
    return empty_db_engine


class QueueSeam:
    """The subprocess seam answering `squeue --json` with `jobs`; counts the calls."""

    def __init__(self, jobs: Sequence[Mapping[str, object]] = ()) -> None:
        self.jobs = list(jobs)
        self.calls = 0

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
        assert tuple(argv[:2]) == ("squeue", "--json")
        self.calls += 1
        text = json.dumps({"meta": {}, "errors": [], "jobs": self.jobs})
        return CommandResult(tuple(argv), 0, text, "", 0.01)


class AccountingSlurm(FakeSlurm):
    """Accounting holds `ended` (jobs whose comment 22.05 stored once they ended); slurmctld's
    queue is what `queue` answers, read by the real squeue parser."""

    def __init__(self, ended: Iterable[SlurmJob] = (), queue: QueueSeam | None = None) -> None:
        super().__init__()
        self.ended = tuple(ended)
        self.queue = queue or QueueSeam()
        self.accounting_calls = 0

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> tuple[SlurmJob, ...]:
        self.accounting_calls += 1
        return self.ended

    def queued_jobs(self) -> tuple[QueuedJob, ...]:
        return SlurmCli(runner=self.queue).queued_jobs()


def queued(job_id: int, user: str, comment: str) -> dict[str, object]:
    return {"job_id": job_id, "user_name": user, "comment": comment, "array_task_id": None}


def accounted(job_id: int, user: str, comment: str) -> SlurmJob:
    return dataclasses.replace(failed_job(job_id), user=user, comment=comment)


def relaunch_intent(engine: Engine) -> action_rows.SubmitIntent:
    """An approved relaunch of alice's lineage whose sbatch answer was lost."""
    with make_session_factory(engine)() as session:
        start_lineage(session, 9001)
        result = handle_ended_job(session, failed_job(9001), deps({9001: FRAGMENTED}))
        assert result.approved
        assert result.proposal_id is not None
        intent = action_rows.record_submit_intent(
            session,
            proposal_id=result.proposal_id,
            build_argv=lambda token: ["sbatch", f"--comment={token}"],
            actor=DAEMON,
        )
        session.commit()
    return intent


def reconcile_at(
    engine: Engine, slurm: AccountingSlurm, *, after: timedelta = SETTLED
) -> list[tuple[int, int | None]]:
    """Reconcile `after` past now (the settle time is 60 s): (action id, job found) closed."""
    now = datetime.now(UTC) + after
    with make_session_factory(engine)() as session:
        closed = reconcile(session, slurm, now=now, settle=SETTLE, actor=DAEMON)
        session.commit()
    return [(c.action_id, c.job_id) for c in closed]


def reconcile_relaunch(
    engine: Engine, seam: QueueSeam, slurm: AccountingSlurm, *, after: timedelta = SETTLED
) -> list[tuple[int, int | None]]:
    slurm.queue = seam
    return reconcile_at(engine, slurm, after=after)


def foreign_notes(engine: Engine) -> list[tuple[str, str, object, object]]:
    with make_session_factory(engine)() as session:
        events = session.scalars(select(AuditEvent).where(AuditEvent.verb == VERB_FOREIGN_TOKEN))
        return [(e.subject_type, e.subject_id, e.details["job"], e.details["user"]) for e in events]


def test_the_relaunch_is_the_owners_job_not_another_users_carrying_its_token(
    fresh_engine: Engine,
) -> None:
    intent = relaunch_intent(fresh_engine)
    seam = QueueSeam([queued(9101, "bob", intent.token), queued(9102, "alice", intent.token)])
    assert reconcile_relaunch(fresh_engine, seam, AccountingSlurm()) == [(intent.action_id, 9102)]
    with make_session_factory(fresh_engine)() as session:
        proposal = session.get(Proposal, intent.proposal_id)
        assert proposal is not None
        assert proposal.relaunch_job_id == 9102
    assert foreign_notes(fresh_engine) == [("proposal", str(intent.proposal_id), 9101, "bob")]


def test_a_token_only_another_user_carries_finds_nothing_and_is_noted_once(
    fresh_engine: Engine,
) -> None:
    intent = relaunch_intent(fresh_engine)
    seam = QueueSeam([queued(9201, "bob", intent.token)])
    bob_ended = AccountingSlurm([accounted(9202, "bob", intent.token)])
    assert (
        reconcile_relaunch(fresh_engine, seam, bob_ended, after=timedelta(0)) == []
    )  # not settled
    assert reconcile_relaunch(fresh_engine, seam, bob_ended) == [(intent.action_id, None)]
    with make_session_factory(fresh_engine)() as session:
        proposal = session.get(Proposal, intent.proposal_id)
        assert proposal is not None
        assert (proposal.state, proposal.relaunch_job_id) == ("approved", None)
    assert sorted(foreign_notes(fresh_engine)) == [
        ("proposal", str(intent.proposal_id), 9201, "bob"),
        ("proposal", str(intent.proposal_id), 9202, "bob"),
    ]


def test_a_token_inside_a_longer_word_of_a_comment_is_not_the_token(
    fresh_engine: Engine,
) -> None:
    intent = relaunch_intent(fresh_engine)
    seam = QueueSeam(
        [queued(9301, "alice", f"x{intent.token}"), queued(9302, "alice", f"{intent.token}0")]
    )
    ended = AccountingSlurm([accounted(9303, "alice", f"run:{intent.token}")])
    assert reconcile_relaunch(fresh_engine, seam, ended) == [(intent.action_id, None)]
    assert foreign_notes(fresh_engine) == []


def test_in_accounting_too_only_the_owners_job_counts(fresh_engine: Engine) -> None:
    intent = relaunch_intent(fresh_engine)
    ended = AccountingSlurm(
        [accounted(9401, "bob", intent.token), accounted(9402, "alice", f"  {intent.token}\n")]
    )
    assert reconcile_relaunch(fresh_engine, QueueSeam(), ended) == [(intent.action_id, 9402)]
    assert foreign_notes(fresh_engine) == [("proposal", str(intent.proposal_id), 9401, "bob")]


# ------------------------------------------------------------------- first submissions


class DiesAtSbatch(AccountingSlurm):
    """`slurm-medic submit` killed while sbatch runs: the intent is all the record holds."""

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
        raise SystemExit("killed")


def first_submission_intent(engine: Engine) -> tuple[int, str]:
    """The real first submission for alice, killed after its intent: (lineage id, token)."""
    template = load_template(TEMPLATE_DIR)
    first = initial_revision(template)
    with make_session_factory(engine)() as session:
        with pytest.raises(SystemExit):
            submit_new_lineage(
                session,
                DiesAtSbatch(),
                Sbatch(first.script, "alice", "/home/alice"),
                name=template.name,
                template_dir=str(TEMPLATE_DIR),
                knobs=knobs_to_json(first.knobs),
                actor=repo.Actor.user("alice", 1001),
            )
        session.rollback()
        intent = action_rows.pending_intents(session)[-1]  # the newest
        assert intent.lineage_id is not None
        return intent.lineage_id, intent.token


def reconcile_first(engine: Engine, seam: QueueSeam) -> list[tuple[int | None, int | None]]:
    """Reconcile past the settle time: (lineage id, job found) for each intent closed."""
    now = datetime.now(UTC) + SETTLED
    with make_session_factory(engine)() as session:
        closed = reconcile(
            session, AccountingSlurm(queue=seam), now=now, settle=SETTLE, actor=DAEMON
        )
    return [(c.lineage_id, c.job_id) for c in closed]


def test_a_first_submission_is_found_only_on_the_owners_job(fresh_engine: Engine) -> None:
    lineage_id, token = first_submission_intent(fresh_engine)
    seam = QueueSeam([queued(9501, "bob", token), queued(9502, "alice", token)])
    assert reconcile_first(fresh_engine, seam) == [(lineage_id, 9502)]
    assert foreign_notes(fresh_engine) == [("lineage", str(lineage_id), 9501, "bob")]


def test_a_first_submission_token_on_another_users_job_closes_as_never_submitted(
    fresh_engine: Engine,
) -> None:
    lineage_id, token = first_submission_intent(fresh_engine)
    assert reconcile_first(fresh_engine, QueueSeam([queued(9601, "bob", token)])) == [
        (lineage_id, None)
    ]
    with make_session_factory(fresh_engine)() as session:
        lineage = session.get(Lineage, lineage_id)
        assert lineage is not None
        assert lineage.attempts == 0
    assert foreign_notes(fresh_engine) == [("lineage", str(lineage_id), 9601, "bob")]


# --------------------------------------------------------------------- the real cluster


@pytest.mark.cluster
@pytest.mark.usefixtures("devcluster")
def test_a_comment_forging_a_queue_line_stays_inside_its_own_job() -> None:
    token = action_rows.new_token()
    forged = f"x\n{2**31}|alice|{token}"
    with user_dir("medic-token", "bob") as work_dir:
        job_id = SlurmCli().submit(
            "#!/bin/bash\nsleep 60\n",
            as_user="bob",
            comment=forged,
            work_dir=str(work_dir),
            extra_args=["--output=/dev/null"],
        )
        try:
            mentioning = [job for job in SlurmCli().queued_jobs() if token in job.comment]
        finally:
            SlurmCli().cancel(job_id)
    # One job, bob's, comment whole (pending or running by now).
    assert [(job.job_id, job.user, job.comment) for job in mentioning] == [(job_id, "bob", forged)]
    assert not carries_token(forged, token)


def test_one_reconciliation_asks_the_queue_and_accounting_once_for_every_intent(
    fresh_engine: Engine,
) -> None:
    """Before: one squeue (and one sacct) per intent; now one of each per reconciliation."""
    intents = [first_submission_intent(fresh_engine) for _ in range(3)]
    seam = QueueSeam([queued(9700, "alice", intents[0][1])])
    slurm = AccountingSlurm(queue=seam)
    now = datetime.now(UTC) + SETTLED
    with make_session_factory(fresh_engine)() as session:
        closed = reconcile(session, slurm, now=now, settle=SETTLE, actor=DAEMON)
    assert sorted((c.lineage_id or 0, c.job_id or 0) for c in closed) == sorted(
        [(intents[0][0], 9700), (intents[1][0], 0), (intents[2][0], 0)]
    )
    assert (seam.calls, slurm.accounting_calls) == (1, 1)
