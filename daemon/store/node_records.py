"""The fleet's record: each node check (probe, judgement, decision) and the questions an admin
asks of it: when was each node last checked, which nodes had a finding in a time range and
which jobs died on them before they were drained, and one node's whole story."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TypeVar

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from daemon.fleet.findings import NodeJudgement
from daemon.store.models import (
    CheckTrigger,
    Incident,
    Job,
    NodeCheck,
    NodeEvent,
    NodeEventKind,
)

# A node's story and a finding's history are read for people: bounded, newest kept.
MAX_STORY_ROWS = 500
MAX_JOBS_SCANNED = 20_000


def record_check(
    session: Session,
    judgement: NodeJudgement,
    *,
    trigger: CheckTrigger,
    decision: str,
    decision_reason: str,
    actor_name: str,
    after_job_id: int | None = None,
) -> NodeCheck:
    row = NodeCheck(
        node=judgement.node,
        checked_at=judgement.probed_at,
        trigger=trigger.value,
        health=judgement.health.value,
        deciding=judgement.deciding,
        kinds="," + "".join(f"{kind.value}," for kind in judgement.kinds()),
        findings=[
            {**asdict(finding), "kind": finding.kind.value, "health": finding.health.value}
            for finding in judgement.findings
        ],
        notes=list(judgement.notes),
        gpus_seen=judgement.gpus_seen,
        gpus_expected=judgement.gpus_expected,
        running_jobs=list(judgement.running_jobs),
        after_job_id=after_job_id,
        decision=decision,
        decision_reason=decision_reason,
        actor_name=actor_name,
    )
    session.add(row)
    session.flush()
    return row


def last_checked(session: Session, nodes: Iterable[str]) -> dict[str, datetime]:
    """Each node's latest check time (nodes never checked are absent). The daemon asks this
    every cycle for the whole fleet, so it is one index seek per node (the newest row of
    `ix_node_check_node_id`), never a scan of a year of checks."""
    newest = (
        select(NodeCheck.checked_at)
        .where(NodeCheck.node == bindparam("node"))
        .order_by(NodeCheck.id.desc())
        .limit(1)
    )
    found: dict[str, datetime] = {}
    for node in dict.fromkeys(nodes):
        at = session.scalar(newest, {"node": node})
        if at is not None:
            found[node] = at
    return found


def latest_checks(session: Session) -> dict[str, NodeCheck]:
    """Every node the record knows a check of, with its latest check."""
    latest = select(func.max(NodeCheck.id).label("last_id")).group_by(NodeCheck.node).subquery()
    query = select(NodeCheck).join(latest, NodeCheck.id == latest.c.last_id)
    return {row.node: row for row in session.scalars(query)}


def event_nodes(session: Session) -> list[str]:
    """Every node with a drain or resume on the record, checked or not (`nodes` lists them)."""
    return list(session.scalars(select(NodeEvent.node).distinct().order_by(NodeEvent.node)))


def checks_after(session: Session, node: str, *, after_id: int) -> list[NodeCheck]:
    """The node's checks after a given row (e.g. since its drain's check), oldest first: the
    newest `MAX_STORY_ROWS`, so a node drained for long is judged on its latest checks."""
    query = (
        select(NodeCheck)
        .where(NodeCheck.node == node, NodeCheck.id > after_id)
        .order_by(NodeCheck.id.desc())
        .limit(MAX_STORY_ROWS)
    )
    return list(reversed(list(session.scalars(query))))


def check_before(session: Session, node: str, *, at: datetime) -> int:
    """The id of the node's last check at or before `at` (0: none), to count checks from."""
    query = select(func.max(NodeCheck.id)).where(NodeCheck.node == node, NodeCheck.checked_at <= at)
    return int(session.scalar(query) or 0)


@dataclass(frozen=True)
class FindingHistory:
    """One node that showed a finding in a time range: when, what became of it, and the jobs
    slurm-medic saw die on it from the range's start until it was drained."""

    node: str
    first_seen: datetime
    last_seen: datetime
    checks: int
    deciding: str
    drained_at: datetime | None
    drain_reason: str | None
    jobs_died: tuple[Job, ...]


def finding_history(
    session: Session, *, kind: str, since: datetime, until: datetime
) -> list[FindingHistory]:
    """Which nodes had `kind` between `since` and `until`, and which jobs died on them before
    slurm-medic (or a person through it) drained them."""
    rows = list(
        session.scalars(
            select(NodeCheck)
            .where(
                NodeCheck.kinds.contains(f",{kind},", autoescape=True),
                NodeCheck.checked_at >= since,
                NodeCheck.checked_at <= until,
            )
            .order_by(NodeCheck.id)
        )
    )
    by_node: dict[str, list[NodeCheck]] = {}
    for row in rows:
        by_node.setdefault(row.node, []).append(row)
    histories = []
    for node, checks in sorted(by_node.items()):
        drain = session.scalars(
            select(NodeEvent)
            .where(
                NodeEvent.node == node,
                NodeEvent.kind == NodeEventKind.DRAIN.value,
                # The drain that answered the finding, not one undone before it was seen.
                NodeEvent.occurred_at >= checks[0].checked_at,
            )
            .order_by(NodeEvent.id)
            .limit(1)
        ).first()
        end = drain.occurred_at if drain is not None else until
        histories.append(
            FindingHistory(
                node=node,
                first_seen=checks[0].checked_at,
                last_seen=checks[-1].checked_at,
                checks=len(checks),
                deciding=checks[-1].deciding,
                drained_at=drain.occurred_at if drain is not None else None,
                drain_reason=drain.reason if drain is not None else None,
                jobs_died=tuple(jobs_on_node(session, node, since=since, until=end)),
            )
        )
    return histories


def jobs_on_node(session: Session, node: str, *, since: datetime, until: datetime) -> list[Job]:
    """Jobs on the record (the failed ones slurm-medic saw) that ran on `node` and ended in the
    range; the job's node list is JSON, so the range is read first, bounded, then filtered."""
    query = (
        select(Job)
        .where(Job.end_time >= since, Job.end_time <= until)
        .order_by(Job.end_time)
        .limit(MAX_JOBS_SCANNED)
    )
    return [job for job in session.scalars(query) if node in (job.nodes or [])]


@dataclass(frozen=True)
class NodeStory:
    node: str
    checks: tuple[NodeCheck, ...]
    events: tuple[NodeEvent, ...]
    incidents: tuple[Incident, ...]


def node_story(session: Session, node: str) -> NodeStory:
    """Every check, drain and resume of a node, and the incidents whose failing node it was:
    the newest `MAX_STORY_ROWS` of each, oldest first."""
    return NodeStory(
        node=node,
        checks=_newest_of(session, NodeCheck, node),
        events=_newest_of(session, NodeEvent, node),
        incidents=_newest_of(session, Incident, node),
    )


NodeRow = TypeVar("NodeRow", NodeCheck, NodeEvent, Incident)


def _newest_of(session: Session, model: type[NodeRow], node: str) -> tuple[NodeRow, ...]:
    query = select(model).where(model.node == node).order_by(model.id.desc()).limit(MAX_STORY_ROWS)
    return tuple(reversed(list(session.scalars(query))))
