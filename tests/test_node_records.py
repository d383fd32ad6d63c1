"""The fleet's record (both databases): checks as judged, each node's latest and last check,
the checks since a drain (newest kept), which nodes had a finding and which jobs died on them
before the drain, and one node's story in order."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence, FindingKind, ProbeVerdict
from daemon.fleet.findings import Finding, NodeJudgement
from daemon.store import control, node_records
from daemon.store import repository as repo
from daemon.store.models import CheckTrigger, NodeEventKind
from tests.factories import ended_job

T0 = datetime(2026, 11, 1, 0, 0, tzinfo=UTC)
PENDING = Finding(
    FindingKind.REMAP_PENDING,
    ProbeVerdict.FAULTY,
    "GPU 2 (00000000:47:00.0): row remap pending (1 correctable, 0 uncorrectable rows)",
    2,
)
CORRECTABLE = Finding(
    FindingKind.ECC_CORRECTABLE,
    ProbeVerdict.DEGRADED,
    "GPU 2 (00000000:47:00.0): 177 correctable",
    2,
)


def judgement(
    node: str, at: datetime, *findings: Finding, jobs: tuple[int, ...] = ()
) -> NodeJudgement:
    return NodeJudgement(
        node=node,
        probed_at=at,
        health=findings[0].health if findings else ProbeVerdict.HEALTHY,
        findings=findings,
        deciding=findings[0].text if findings else "8 GPUs of 8: healthy",
        gpus_seen=8,
        gpus_expected=8,
        running_jobs=jobs,
        notes=("a note",) if jobs else (),
    )


def check(session: Session, node: str, at: datetime, *findings: Finding) -> int:
    row = node_records.record_check(
        session,
        judgement(node, at, *findings),
        trigger=CheckTrigger.SCHEDULE,
        decision="record",
        decision_reason="r",
        actor_name="slurm-medic",
    )
    return row.id


def test_a_check_keeps_the_judgement_and_the_decision(db_session: Session) -> None:
    row = node_records.record_check(
        db_session,
        judgement("gpu-01", T0, PENDING, CORRECTABLE, jobs=(501, 502)),
        trigger=CheckTrigger.AFTER_JOB,
        decision="drain_after_job",
        decision_reason="remap_pending: drained after job(s) 501, 502 end",
        actor_name="slurm-medic",
        after_job_id=499,
    )
    db_session.commit()
    db_session.expire(row)
    assert (row.node, row.checked_at, row.trigger, row.health) == (
        "gpu-01",
        T0,
        "after_job",
        "faulty",
    )
    assert row.kinds == ",remap_pending,ecc_correctable,"
    assert row.deciding == PENDING.text
    assert row.findings == [
        {"kind": "remap_pending", "health": "faulty", "text": PENDING.text, "gpu": 2},
        {"kind": "ecc_correctable", "health": "degraded", "text": CORRECTABLE.text, "gpu": 2},
    ]
    assert (row.running_jobs, row.notes, row.after_job_id) == ([501, 502], ["a note"], 499)
    assert (row.decision, row.actor_name) == ("drain_after_job", "slurm-medic")
    healthy = db_session.get(type(row), check(db_session, "gpu-02", T0))
    assert healthy is not None
    assert (healthy.kinds, healthy.findings, healthy.health) == (",", [], "healthy")


def test_latest_and_last_checked_per_node(db_session: Session) -> None:
    check(db_session, "gpu-01", T0, PENDING)
    check(db_session, "gpu-02", T0 + timedelta(minutes=5))
    newest = check(db_session, "gpu-01", T0 + timedelta(minutes=10))
    latest = node_records.latest_checks(db_session)
    assert latest["gpu-01"].id == newest
    assert latest["gpu-01"].health == "healthy"
    assert set(latest) == {"gpu-01", "gpu-02"}

    names = [f"node{n:04d}" for n in range(1200)] + ["gpu-02", "gpu-01", "gpu-01"]
    assert node_records.last_checked(db_session, names) == {
        "gpu-01": T0 + timedelta(minutes=10),
        "gpu-02": T0 + timedelta(minutes=5),
    }
    assert node_records.last_checked(db_session, []) == {}


def test_checks_after_a_row_keep_the_newest_oldest_first(
    db_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_records, "MAX_STORY_ROWS", 3)
    ids = [check(db_session, "gpu-03", T0 + timedelta(minutes=n)) for n in range(6)]
    check(db_session, "gpu-04", T0 + timedelta(minutes=9))
    assert [row.id for row in node_records.checks_after(db_session, "gpu-03", after_id=ids[0])] == (
        ids[3:]
    )
    assert [row.id for row in node_records.checks_after(db_session, "gpu-03", after_id=ids[4])] == [
        ids[5]
    ]
    assert node_records.check_before(db_session, "gpu-03", at=T0 + timedelta(minutes=2)) == ids[2]
    assert node_records.check_before(db_session, "gpu-03", at=T0 - timedelta(seconds=1)) == 0


def died(session: Session, job_id: int, node: str, at: datetime) -> None:
    repo.record_job(session, job=ended_job(job_id, end=at, nodes=(node, "gpu-99")))


def drain(session: Session, node: str, at: datetime, reason: str) -> None:
    control.record_node_event(
        session,
        node=node,
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason=reason,
        occurred_at=at,
        finding=FindingKind.REMAP_PENDING.value,
    )


def test_finding_history_lists_the_jobs_that_died_before_the_drain(db_session: Session) -> None:
    hour = timedelta(hours=1)
    since, until = T0, T0 + 30 * 24 * hour
    # Drained and resumed for something else before the remap was ever seen.
    drain(db_session, "gpu-01", T0 + 2 * hour, "medic: XID 79 killed job 600")
    control.record_node_event(
        db_session,
        node="gpu-01",
        kind=NodeEventKind.RESUME,
        by_medic=True,
        reason="admin",
        occurred_at=T0 + 3 * hour,
    )
    check(db_session, "gpu-01", T0 + 10 * hour, PENDING, CORRECTABLE)
    died(db_session, 701, "gpu-01", T0 + 11 * hour)  # died on the pending remap
    check(db_session, "gpu-01", T0 + 12 * hour, PENDING)
    drain(db_session, "gpu-01", T0 + 13 * hour, "medic: sweep: row remap pending")
    died(db_session, 702, "gpu-01", T0 + 14 * hour)  # after the drain: not the remap's
    died(db_session, 703, "gpu-02", T0 + 11 * hour)  # another node
    check(db_session, "gpu-02", T0 + 11 * hour, CORRECTABLE)  # another finding
    check(db_session, "gpu-03", T0 - hour, PENDING)  # before the range
    check(db_session, "gpu-05", T0 + 20 * hour, PENDING)  # never drained
    died(db_session, 705, "gpu-05", T0 + 21 * hour)

    histories = node_records.finding_history(
        db_session, kind=FindingKind.REMAP_PENDING.value, since=since, until=until
    )
    assert [history.node for history in histories] == ["gpu-01", "gpu-05"]
    first, never = histories
    assert (first.first_seen, first.last_seen, first.checks) == (
        T0 + 10 * hour,
        T0 + 12 * hour,
        2,
    )
    assert (first.drained_at, first.drain_reason) == (
        T0 + 13 * hour,
        "medic: sweep: row remap pending",
    )
    assert [job.slurm_job_id for job in first.jobs_died] == [701]
    assert (never.drained_at, [job.slurm_job_id for job in never.jobs_died]) == (None, [705])
    assert node_records.finding_history(db_session, kind="remap", since=since, until=until) == []


def test_a_nodes_story_is_in_order_and_bounded_to_the_newest(
    db_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    hardware = Diagnosis(
        FailureKind.HARDWARE, Confidence.HIGH, ("XID 79 on gpu-06",), node="gpu-06"
    )
    checks = [check(db_session, "gpu-06", T0 + timedelta(minutes=n), PENDING) for n in range(3)]
    check(db_session, "gpu-07", T0)
    drain(db_session, "gpu-06", T0 + timedelta(minutes=5), "medic: sweep: one")
    drain(db_session, "gpu-06", T0 + timedelta(minutes=6), "medic: sweep: two")
    incidents = []
    for job_id in (801, 802):
        died(db_session, job_id, "gpu-06", T0 + timedelta(minutes=job_id - 800))
        incident = repo.record_incident(
            db_session, slurm_job_id=job_id, evidence=Evidence(), diagnosis=hardware
        )
        incidents.append(incident.id)
    other = replace(hardware, node="gpu-07")
    died(db_session, 803, "gpu-07", T0)
    repo.record_incident(db_session, slurm_job_id=803, evidence=Evidence(), diagnosis=other)

    story = node_records.node_story(db_session, "gpu-06")
    assert [row.id for row in story.checks] == checks
    assert [event.reason for event in story.events] == ["medic: sweep: one", "medic: sweep: two"]
    assert [row.id for row in story.incidents] == incidents

    monkeypatch.setattr(node_records, "MAX_STORY_ROWS", 2)
    bounded = node_records.node_story(db_session, "gpu-06")
    assert [row.id for row in bounded.checks] == checks[1:]
    assert [row.id for row in bounded.incidents] == incidents
    assert node_records.node_story(db_session, "gpu-42").checks == ()
