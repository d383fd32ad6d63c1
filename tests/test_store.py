"""The record, on SQLite and on a real PostgreSQL: every test runs once per database."""

from __future__ import annotations

import dataclasses
import threading
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, delete, select, text, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.evidence.records import (
    Evidence,
    LogFindings,
    NodeProbe,
    OomFamily,
    OomReport,
    Phase,
    ProbeVerdict,
)
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import action_rows, control, queries
from daemon.store import repository as repo
from daemon.store.engine import make_session_factory
from daemon.store.models import (
    NUL_STAND_IN,
    Action,
    ActionKind,
    ActionResult,
    AuditEvent,
    AuditImmutable,
    Incident,
    Job,
    LineageStatus,
    NodeEventKind,
    Proposal,
)
from daemon.store.schema import upgrade
from daemon.store.states import TRANSITIONS, IllegalTransition, ProposalState, check_transition
from tests.fixes import seeded_fix

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
DAEMON = repo.Actor.daemon()
ALICE = repo.Actor.user("alice", 1001)


def make_job(job_id: int, *, name: str = "llama-7b", end: datetime = T0) -> SlurmJob:
    return SlurmJob(
        job_id=job_id,
        name=name,
        user="alice",
        uid=1001,
        group="alice",
        account="research",
        partition="gpu",
        state=JobState.FAILED,
        state_raw="FAILED",
        exit_code=1,
        exit_signal=None,
        derived_exit_code=None,
        derived_exit_signal=None,
        nodes=("gpu-01", "gpu-02"),
        batch_host="gpu-01",
        submit_time=end - timedelta(hours=2),
        start_time=end - timedelta(hours=1),
        end_time=end,
        stdout_path="/home/alice/run/%j.out",
        stderr_path=None,
        work_dir="/home/alice/run",
        comment="medic-lineage",
    )


def make_evidence(job: SlurmJob) -> Evidence:
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        requested_bytes=2 * 2**30,
        total_bytes=80 * 2**30,
        free_bytes=2**29,
    )
    probe = NodeProbe(
        node="gpu-02", probed_at=T0, verdict=ProbeVerdict.HEALTHY, reasons=("no XID in window",)
    )
    log = LogFindings(rank=3, node="gpu-02", step=1200, phase=Phase.BACKWARD, oom=oom)
    return Evidence(log=log, job=job, probe=probe, job_gpu_uuids=("GPU-1",))


def make_diagnosis(kind: FailureKind = FailureKind.TRUE_OOM) -> Diagnosis:
    return Diagnosis(
        kind=kind,
        confidence=Confidence.HIGH,
        reasons=("reserved 79.5 GiB of 80 GiB",),
        onset=Onset.MID_RUN,
        rank=3,
        node="gpu-02",
        step=1200,
        phase=Phase.BACKWARD,
    )


def seed_incident(
    session: Session,
    *,
    job_id: int = 4242,
    lineage_id: int | None = None,
    attempt: int | None = None,
    kind: FailureKind = FailureKind.TRUE_OOM,
    at: datetime = T0,
) -> Incident:
    job = make_job(job_id, end=at)
    repo.record_job(session, job=job, lineage_id=lineage_id, attempt=attempt)
    return repo.record_incident(
        session, slurm_job_id=job_id, evidence=make_evidence(job), diagnosis=make_diagnosis(kind)
    )


def seed_proposal(session: Session, *, incident_id: int) -> Proposal:
    return repo.propose(
        session,
        incident_id=incident_id,
        fix=seeded_fix(changes=(("micro_batch", 8, 4), ("grad_accum", 4, 8))),
        rationale="halve the micro-batch, double accumulation: global batch kept",
        cost=1.0,
        changes_science=False,
        actor=DAEMON,
    )


def approved_proposal(session: Session, *, job_id: int = 4242) -> Proposal:
    incident = seed_incident(session, job_id=job_id)
    proposal = seed_proposal(session, incident_id=incident.id)
    repo.transition_proposal(
        session, proposal_id=proposal.id, to=ProposalState.APPROVED, actor=ALICE
    )
    return proposal


def sbatch_argv(token: str) -> list[str]:
    return ["sbatch", "--parsable", f"--comment={token}", "/srv/medic/rev-7.sbatch"]


# --- the transition table (pure) ---------------------------------------------------------


@pytest.mark.parametrize("current", list(ProposalState))
@pytest.mark.parametrize("wanted", list(ProposalState))
def test_transition_table_is_the_only_judge(current: ProposalState, wanted: ProposalState) -> None:
    if wanted in TRANSITIONS[current]:
        check_transition(current, wanted)
    else:
        with pytest.raises(IllegalTransition):
            check_transition(current, wanted)


def test_final_states_allow_nothing() -> None:
    finals = {state for state in ProposalState if state.is_terminal()}
    assert finals == {
        ProposalState.REJECTED,
        ProposalState.EXPIRED,
        ProposalState.VERIFIED,
        ProposalState.FAILED,
        ProposalState.SUPERSEDED,
    }


def test_no_path_skips_the_intent() -> None:
    """Nothing reaches `submitted` except through `submitting`, the state an intent sets."""
    sources = {s for s, targets in TRANSITIONS.items() if ProposalState.SUBMITTED in targets}
    assert sources == {ProposalState.SUBMITTING}


# --- proposals through the repository ------------------------------------------------------


def test_illegal_transition_raises_and_changes_nothing(db_session: Session) -> None:
    incident = seed_incident(db_session)
    proposal = seed_proposal(db_session, incident_id=incident.id)
    with pytest.raises(IllegalTransition, match="from proposed to verified"):
        repo.transition_proposal(
            db_session, proposal_id=proposal.id, to=ProposalState.VERIFIED, actor=DAEMON
        )
    db_session.expire_all()
    assert db_session.get(Proposal, proposal.id).state == "proposed"  # type: ignore[union-attr]
    verbs = [e.verb for e in queries.proposal_audit_trail(db_session, proposal_id=proposal.id)]
    assert verbs == ["propose"]


def test_rejected_proposal_cannot_be_approved(db_session: Session) -> None:
    incident = seed_incident(db_session)
    proposal = seed_proposal(db_session, incident_id=incident.id)
    repo.transition_proposal(
        db_session, proposal_id=proposal.id, to=ProposalState.REJECTED, actor=ALICE, reason="no"
    )
    assert proposal.decided_by == "alice"
    with pytest.raises(IllegalTransition):
        repo.transition_proposal(
            db_session, proposal_id=proposal.id, to=ProposalState.APPROVED, actor=ALICE
        )


def test_state_column_refuses_unknown_values(db_session: Session) -> None:
    incident = seed_incident(db_session)
    proposal = seed_proposal(db_session, incident_id=incident.id)
    with pytest.raises(DBAPIError), db_session.begin_nested():
        db_session.execute(
            text("UPDATE proposal SET state = 'teleported' WHERE id = :id"), {"id": proposal.id}
        )


# --- the audit log is append-only -----------------------------------------------------------


def _one_audit_event(session: Session) -> AuditEvent:
    event = repo.append_audit(
        session, actor=ALICE, verb="approve", subject_type="proposal", subject_id=1
    )
    session.flush()
    return event


def test_audit_event_cannot_be_changed_through_the_orm(db_session: Session) -> None:
    event = _one_audit_event(db_session)
    event.verb = "reject"
    with pytest.raises(AuditImmutable, match="cannot be changed"):
        db_session.flush()


def test_audit_event_cannot_be_deleted_through_the_orm(db_session: Session) -> None:
    event = _one_audit_event(db_session)
    db_session.delete(event)
    with pytest.raises(AuditImmutable, match="cannot be deleted"):
        db_session.flush()


@pytest.mark.parametrize(
    "statement",
    [update(AuditEvent).values(verb="reject"), delete(AuditEvent)],
    ids=["bulk-update", "bulk-delete"],
)
def test_bulk_statements_on_audit_events_are_refused(
    db_session: Session, statement: object
) -> None:
    _one_audit_event(db_session)
    with pytest.raises(AuditImmutable):
        db_session.execute(statement)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "sql", ["UPDATE audit_event SET verb = 'reject'", "DELETE FROM audit_event"]
)
def test_database_trigger_refuses_raw_sql(db_session: Session, sql: str) -> None:
    event = _one_audit_event(db_session)
    with pytest.raises(DBAPIError, match="append-only"), db_session.begin_nested():
        db_session.execute(text(sql))
    assert db_session.scalars(select(AuditEvent.verb).where(AuditEvent.id == event.id)).one() == (
        "approve"
    )


# --- exactly once ---------------------------------------------------------------------------


def test_intent_then_submitted(db_session: Session) -> None:
    proposal = approved_proposal(db_session)
    intent = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    assert intent.token.startswith(action_rows.TOKEN_PREFIX)
    assert f"--comment={intent.token}" in intent.argv
    assert proposal.state == "submitting"
    assert action_rows.pending_intents(db_session) == [intent]

    action = action_rows.record_submitted(
        db_session, intent=intent, slurm_job_id=5001, actor=DAEMON, stdout="5001\n"
    )
    assert action.result == ActionResult.SUCCEEDED
    assert proposal.state == "submitted"
    assert proposal.relaunch_job_id == 5001
    assert action_rows.pending_intents(db_session) == []
    with pytest.raises(action_rows.IntentError, match="already closed"):
        action_rows.record_submitted(db_session, intent=intent, slurm_job_id=5001, actor=DAEMON)


def test_intent_requires_approval(db_session: Session) -> None:
    incident = seed_incident(db_session)
    proposal = seed_proposal(db_session, incident_id=incident.id)
    with pytest.raises(IllegalTransition, match="from proposed to submitting"):
        action_rows.record_submit_intent(
            db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
        )
    assert action_rows.pending_intents(db_session) == []


def test_argv_without_the_token_records_nothing(db_session: Session) -> None:
    proposal = approved_proposal(db_session)
    with pytest.raises(action_rows.IntentError, match="token"):
        action_rows.record_submit_intent(
            db_session,
            proposal_id=proposal.id,
            build_argv=lambda _token: ["sbatch", "x.sbatch"],
            actor=DAEMON,
        )
    assert proposal.state == "approved"
    assert db_session.scalars(select(Action)).all() == []


def test_each_intent_gets_its_own_token(db_session: Session) -> None:
    first = action_rows.record_submit_intent(
        db_session,
        proposal_id=approved_proposal(db_session).id,
        build_argv=sbatch_argv,
        actor=DAEMON,
    )
    second = action_rows.record_submit_intent(
        db_session,
        proposal_id=approved_proposal(db_session, job_id=4243).id,
        build_argv=sbatch_argv,
        actor=DAEMON,
    )
    assert first.token != second.token
    assert action_rows.pending_intents(db_session) == [first, second]


def test_reconcile_found_closes_as_submitted(db_session: Session) -> None:
    proposal = approved_proposal(db_session)
    intent = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    (pending,) = action_rows.pending_intents(db_session)
    action_rows.reconcile_intent(db_session, intent=pending, found_job_id=777, actor=DAEMON)
    assert proposal.state == "submitted"
    assert proposal.relaunch_job_id == 777
    verbs = [e.verb for e in queries.proposal_audit_trail(db_session, proposal_id=proposal.id)]
    assert verbs == [
        "propose",
        "proposal_approved",
        "proposal_submitting",
        "submit_intent",
        "proposal_submitted",
        "reconciled_found",
    ]
    assert intent.token in str(
        queries.proposal_audit_trail(db_session, proposal_id=proposal.id)[3].details
    )


def test_reconcile_not_found_returns_to_approved_and_allows_a_new_intent(
    db_session: Session,
) -> None:
    proposal = approved_proposal(db_session)
    intent = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    action = action_rows.reconcile_intent(
        db_session, intent=intent, found_job_id=None, actor=DAEMON
    )
    assert action.result == ActionResult.NOT_FOUND
    assert proposal.state == "approved"
    retry = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    assert retry.token != intent.token
    assert action_rows.pending_intents(db_session) == [retry]


def test_sbatch_refusal_fails_the_proposal_with_its_words(db_session: Session) -> None:
    proposal = approved_proposal(db_session)
    intent = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    action_rows.record_submit_failed(
        db_session,
        intent=intent,
        exit_code=1,
        stdout="",
        stderr="sbatch: error: Batch job submission failed: Invalid account",
        actor=DAEMON,
    )
    assert proposal.state == "failed"
    trail = queries.proposal_audit_trail(db_session, proposal_id=proposal.id)
    assert "Invalid account" in str(trail[-1].details["reason"])


def test_forged_intent_is_refused(db_session: Session) -> None:
    proposal = approved_proposal(db_session)
    intent = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    forged = dataclasses.replace(intent, token="medic-forged")
    with pytest.raises(action_rows.IntentError, match="no recorded intent"):
        action_rows.record_submitted(db_session, intent=forged, slurm_job_id=1, actor=DAEMON)


def test_intent_is_committed_before_it_is_returned(
    empty_db_engine: Engine,
) -> None:
    """A second connection sees the intent at once: a crash right after cannot lose it."""
    upgrade(empty_db_engine)
    sessions = make_session_factory(empty_db_engine)
    with sessions() as writer:
        proposal = approved_proposal(writer)
        writer.commit()
        intent = action_rows.record_submit_intent(
            writer, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
        )
        with sessions() as reader:
            assert action_rows.pending_intents(reader) == [intent]


# --- what is stored comes back --------------------------------------------------------------


def test_job_and_incident_records_round_trip(db_session: Session) -> None:
    incident = seed_incident(db_session)
    db_session.expire_all()
    (job,) = db_session.scalars(select(Job)).all()
    assert repo.job_record(job) == make_job(4242)
    evidence, diagnosis = repo.incident_records(incident)
    assert evidence == make_evidence(make_job(4242))
    assert diagnosis == make_diagnosis()
    assert incident.occurred_at == T0
    assert incident.occurred_at.tzinfo is not None


def test_odd_text_is_kept(db_session: Session) -> None:
    job = make_job(9, name="run\x00 😀 \u202e; rm -rf / \ufffd'\"$(x) \U0010ffff")
    repo.record_job(db_session, job=job)
    db_session.expire_all()
    row = db_session.scalars(select(Job).where(Job.slurm_job_id == 9)).one()
    assert row.name == job.name.replace("\x00", NUL_STAND_IN)
    assert repo.job_record(row) == job


def test_naive_datetime_is_refused(db_session: Session) -> None:
    with pytest.raises(Exception, match="naive datetime"):
        control.set_cursor(db_session, name="sacct", polled_until=datetime(2026, 1, 1))


def test_cursor_moves(db_session: Session) -> None:
    assert control.get_cursor(db_session, name="sacct") is None
    control.set_cursor(db_session, name="sacct", polled_until=T0)
    control.set_cursor(db_session, name="sacct", polled_until=T0 + timedelta(minutes=1))
    assert control.get_cursor(db_session, name="sacct") == T0 + timedelta(minutes=1)


def test_job_is_refreshed_not_duplicated(db_session: Session) -> None:
    repo.record_job(db_session, job=make_job(7))
    repo.record_job(db_session, job=make_job(7, name="renamed"))
    assert db_session.scalars(select(Job.name).where(Job.slurm_job_id == 7)).all() == ["renamed"]


def test_incident_needs_its_job(db_session: Session) -> None:
    with pytest.raises(repo.NotFound, match="record_job first"):
        repo.record_incident(
            db_session, slurm_job_id=1, evidence=Evidence(), diagnosis=make_diagnosis()
        )


# --- the questions --------------------------------------------------------------------------


def test_lineage_history_has_every_attempt(db_session: Session) -> None:
    lineage = repo.create_lineage(db_session, name="llama", owner="alice", template="hf-trainer")
    first = seed_incident(db_session, job_id=100, lineage_id=lineage.id, attempt=1)
    proposal = seed_proposal(db_session, incident_id=first.id)
    revision = repo.record_template_revision(
        db_session,
        lineage_id=lineage.id,
        knobs={"micro_batch": 4},
        rendered_script="#!/bin/bash\n",
        proposal_id=proposal.id,
    )
    repo.record_job(db_session, job=make_job(101), lineage_id=lineage.id, attempt=2)
    seed_incident(db_session, job_id=999)  # another run's: must not appear

    history = queries.lineage_story(db_session, lineage_id=lineage.id)
    assert [a.job.slurm_job_id for a in history.attempts] == [100, 101]
    assert [i.id for i in history.attempts[0].incidents] == [first.id]
    assert [p.id for p in history.attempts[0].proposals] == [proposal.id]
    assert history.attempts[1].incidents == ()
    assert history.revisions == (revision,)
    assert len(revision.script_sha256) == 64
    assert history.lineage.attempts == 2


def test_job_story_gathers_everything(db_session: Session) -> None:
    proposal = approved_proposal(db_session, job_id=300)
    drain = action_rows.record_action(
        db_session, kind=ActionKind.DRAIN, argv=["scontrol", "update"], actor=DAEMON, node="gpu-02"
    )
    control.record_node_event(
        db_session,
        node="gpu-02",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: XID 79",
        incident_id=proposal.incident_id,
        action_id=drain.id,
    )
    intent = action_rows.record_submit_intent(
        db_session, proposal_id=proposal.id, build_argv=sbatch_argv, actor=DAEMON
    )
    action_rows.record_submitted(db_session, intent=intent, slurm_job_id=301, actor=DAEMON)

    story = queries.job_story(db_session, slurm_job_id=300)
    assert story is not None
    assert story.job.slurm_job_id == 300
    assert [p.id for p in story.proposals] == [proposal.id]
    assert [a.kind for a in story.actions] == ["sbatch"]
    assert [e.reason for e in story.node_events] == ["medic: XID 79"]
    assert "submit_intent" in [e.verb for e in story.audit]
    assert queries.job_story(db_session, slurm_job_id=123456) is None


def test_drains_in_force_are_medics_and_not_undone(db_session: Session) -> None:
    def event(node: str, kind: NodeEventKind, by_medic: bool) -> None:
        control.record_node_event(
            db_session, node=node, kind=kind, by_medic=by_medic, reason=f"medic: {node}"
        )

    event("gpu-01", NodeEventKind.DRAIN, True)
    event("gpu-02", NodeEventKind.DRAIN, True)
    event("gpu-02", NodeEventKind.RESUME, True)
    event("gpu-03", NodeEventKind.DRAIN, False)
    event("gpu-04", NodeEventKind.RESUME, False)
    event("gpu-04", NodeEventKind.DRAIN, True)
    assert [e.node for e in control.drains_in_force(db_session)] == ["gpu-01", "gpu-04"]


def test_pending_approvals_are_the_undecided_oldest_first(db_session: Session) -> None:
    a = seed_proposal(db_session, incident_id=seed_incident(db_session, job_id=1).id)
    b = seed_proposal(db_session, incident_id=seed_incident(db_session, job_id=2).id)
    c = seed_proposal(db_session, incident_id=seed_incident(db_session, job_id=3).id)
    repo.transition_proposal(db_session, proposal_id=b.id, to=ProposalState.APPROVED, actor=ALICE)
    assert [p.id for p in queries.pending_approvals(db_session)] == [a.id, c.id]


def test_incidents_by_kind_over_a_time_range(db_session: Session) -> None:
    for day, kind in enumerate(
        [FailureKind.TRUE_OOM, FailureKind.HARDWARE, FailureKind.TRUE_OOM, FailureKind.TRUE_OOM]
    ):
        seed_incident(db_session, job_id=10 + day, kind=kind, at=T0 + timedelta(days=day))
    found = queries.incidents_by_kind(
        db_session, kind=FailureKind.TRUE_OOM, since=T0, until=T0 + timedelta(days=3)
    )
    assert [i.slurm_job_id for i in found] == [12, 10]
    counts = queries.count_incidents_by_kind(db_session, since=T0, until=T0 + timedelta(days=4))
    assert counts == {FailureKind.TRUE_OOM: 3, FailureKind.HARDWARE: 1}


def test_audit_trail_of_one_proposal_only(db_session: Session) -> None:
    mine = approved_proposal(db_session, job_id=1)
    approved_proposal(db_session, job_id=2)
    trail = queries.proposal_audit_trail(db_session, proposal_id=mine.id)
    assert [(e.verb, e.actor_name, e.actor_uid) for e in trail] == [
        ("propose", "slurm-medic", None),
        ("proposal_approved", "alice", 1001),
    ]
    assert trail[0].at <= trail[1].at


def test_find_incidents_by_user_and_node(db_session: Session) -> None:
    seed_incident(db_session, job_id=1, at=T0)
    seed_incident(db_session, job_id=2, at=T0 + timedelta(hours=1))
    bob_job = dataclasses.replace(make_job(3), user="bob")
    repo.record_job(db_session, job=bob_job)
    repo.record_incident(
        db_session,
        slurm_job_id=3,
        evidence=Evidence(),
        diagnosis=dataclasses.replace(make_diagnosis(), node="gpu-09"),
        occurred_at=T0,
    )
    end = T0 + timedelta(days=1)

    def found(user: str | None = None, node: str | None = None, limit: int = 10) -> list[int]:
        incidents = queries.find_incidents(
            db_session, since=T0, until=end, user=user, node=node, limit=limit
        )
        return [incident.slurm_job_id for incident in incidents]

    assert found(user="alice") == [2, 1]
    assert found(node="gpu-09") == [3]
    assert found(limit=1) == [2]
    assert found(user="bob", node="gpu-02") == []


def test_side_effects_are_recorded_then_finished_once(db_session: Session) -> None:
    argv = ["scontrol", "update", "NodeName=gpu-02", "State=DRAIN", "Reason=medic: XID 79"]
    action = action_rows.record_action(
        db_session, kind=ActionKind.DRAIN, argv=argv, actor=DAEMON, node="gpu-02"
    )
    assert action.result == ActionResult.PENDING
    action_rows.finish_action(
        db_session, action_id=action.id, exit_code=0, stdout="", stderr="", succeeded=True
    )
    db_session.expire_all()
    stored = db_session.get(Action, action.id)
    assert stored is not None
    assert (stored.result, stored.argv, stored.exit_code) == ("succeeded", argv, 0)
    assert stored.finished_at is not None
    with pytest.raises(action_rows.IntentError, match="already finished"):
        action_rows.finish_action(
            db_session, action_id=action.id, exit_code=1, stdout="", stderr="", succeeded=False
        )


def test_a_relaunch_cannot_bypass_the_intent(db_session: Session) -> None:
    with pytest.raises(action_rows.IntentError, match="record_submit_intent"):
        action_rows.record_action(db_session, kind=ActionKind.SBATCH, argv=["sbatch"], actor=DAEMON)


def test_lineage_status_change_is_audited(db_session: Session) -> None:
    lineage = repo.create_lineage(db_session, name="llama", owner="alice", template="hf")
    repo.set_lineage_status(
        db_session,
        lineage_id=lineage.id,
        status=LineageStatus.EXHAUSTED,
        actor=DAEMON,
        reason="retry budget spent",
    )
    assert lineage.status == "exhausted"
    (event,) = db_session.scalars(
        select(AuditEvent).where(AuditEvent.subject_type == "lineage")
    ).all()
    assert event.details == {"from": "active", "to": "exhausted", "reason": "retry budget spent"}


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.text(max_size=40),
    message=st.text(max_size=200),
    reasons=st.lists(st.text(max_size=30), max_size=3),
)
def test_any_text_survives_the_database(
    db_session: Session, name: str, message: str, reasons: list[str]
) -> None:
    """Job names, OOM messages and reasons come from outside: the JSON copy keeps them exact."""
    with db_session.begin_nested() as example:
        job = make_job(77, name=name)
        repo.record_job(db_session, job=job)
        oom = OomReport(family=OomFamily.CUDA_RUNTIME, message=message)
        evidence = Evidence(log=LogFindings(oom=oom), job=job)
        diagnosis = dataclasses.replace(make_diagnosis(), reasons=tuple(reasons), oom=oom)
        incident = repo.record_incident(
            db_session, slurm_job_id=77, evidence=evidence, diagnosis=diagnosis
        )
        db_session.expire_all()
        assert repo.incident_records(incident) == (evidence, diagnosis)
        stored = db_session.scalars(select(Job).where(Job.slurm_job_id == 77)).one()
        assert repo.job_record(stored) == job
        example.rollback()


def test_two_daemons_racing_for_one_relaunch_record_one_intent(empty_db_engine: Engine) -> None:
    """Two sessions submit the same approved proposal at once: one intent, never two."""
    upgrade(empty_db_engine)
    sessions = make_session_factory(empty_db_engine)
    with sessions() as setup:
        proposal_id = approved_proposal(setup).id
        setup.commit()
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def submit() -> None:
        with sessions() as session:
            barrier.wait()
            try:
                outcomes.append(
                    action_rows.record_submit_intent(
                        session, proposal_id=proposal_id, build_argv=sbatch_argv, actor=DAEMON
                    )
                )
            except (IllegalTransition, OperationalError) as error:
                session.rollback()
                outcomes.append(error)

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    intents = [o for o in outcomes if isinstance(o, action_rows.SubmitIntent)]
    assert len(outcomes) == 2
    assert len(intents) == 1
    with sessions() as reader:
        assert action_rows.pending_intents(reader) == intents
