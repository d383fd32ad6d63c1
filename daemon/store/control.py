"""What the daemon keeps between cycles and what people switch: the watchers' cursors, the
pause switch, and the node events (drains in force among them)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import flag_modified

from daemon.store.models import ControlFlag, Cursor, NodeEvent, NodeEventKind, utc_now
from daemon.store.repository import Actor, append_audit

PAUSE_FLAG = "paused"


def record_node_event(
    session: Session,
    *,
    node: str,
    kind: NodeEventKind,
    by_medic: bool,
    reason: str,
    occurred_at: datetime | None = None,
    incident_id: int | None = None,
    action_id: int | None = None,
    actor_name: str | None = None,
    finding: str | None = None,
    check_id: int | None = None,
) -> NodeEvent:
    event = NodeEvent(
        node=node,
        kind=kind.value,
        by_medic=by_medic,
        reason=reason,
        occurred_at=occurred_at or utc_now(),
        incident_id=incident_id,
        action_id=action_id,
        actor_name=actor_name,
        finding=finding,
        check_id=check_id,
    )
    session.add(event)
    session.flush()
    return event


def drains_in_force(session: Session) -> list[NodeEvent]:
    """Drains slurm-medic made that no later event on the same node has undone."""
    latest = (
        select(NodeEvent.node, func.max(NodeEvent.id).label("last_id"))
        .group_by(NodeEvent.node)
        .subquery()
    )
    query = (
        select(NodeEvent)
        .join(latest, NodeEvent.id == latest.c.last_id)
        .where(NodeEvent.kind == NodeEventKind.DRAIN.value, NodeEvent.by_medic.is_(True))
        .order_by(NodeEvent.node)
    )
    return list(session.scalars(query))


def get_cursor(session: Session, *, name: str) -> datetime | None:
    cursor = session.get(Cursor, name)
    return None if cursor is None else cursor.polled_until


def set_cursor(session: Session, *, name: str, polled_until: datetime) -> None:
    cursor = session.get(Cursor, name)
    if cursor is None:
        session.add(Cursor(name=name, polled_until=polled_until))
    else:
        cursor.polled_until = polled_until
    session.flush()


def advance_cursor(session: Session, *, name: str, polled_until: datetime) -> None:
    """Move the cursor and end any hold: accounting had every record up to `polled_until`."""
    set_cursor(session, name=name, polled_until=polled_until)
    cursor = session.get(Cursor, name)
    if cursor is not None and cursor.held_since is not None:
        cursor.held_since = None
        cursor.held_reason = None
        session.flush()


def hold_cursor(
    session: Session, *, name: str, reason: str, now: datetime, start: datetime
) -> Cursor:
    """Keep the cursor where it is (at `start` when there is none yet) and say why: records
    ended in the gap may still reach accounting, and the next window must reach back to them."""
    cursor = session.get(Cursor, name)
    if cursor is None:
        cursor = Cursor(name=name, polled_until=start)
        session.add(cursor)
        last_moved = None
    else:
        last_moved = cursor.updated_at
    if cursor.held_since is None:
        cursor.held_since = now
    cursor.held_reason = reason[:500]
    if last_moved is not None:
        # `updated_at` says when the cursor last moved (the stale-poll alert reads it): a
        # hold moves nothing.
        cursor.updated_at = last_moved
        flag_modified(cursor, "updated_at")
    session.flush()
    return cursor


def set_paused(session: Session, *, paused: bool, actor: Actor, reason: str) -> ControlFlag:
    """Flip the global pause (the daemon proposes, never acts, while it is on); audited."""
    flag = session.get(ControlFlag, PAUSE_FLAG)
    previous = flag.value if flag is not None else False
    if flag is None:
        flag = ControlFlag(name=PAUSE_FLAG)
        session.add(flag)
    flag.value = paused
    flag.reason = reason
    flag.set_by = actor.name
    flag.set_at = utc_now()
    append_audit(
        session,
        actor=actor,
        verb="pause" if paused else "unpause",
        subject_type="daemon",
        subject_id=PAUSE_FLAG,
        details={"from": previous, "to": paused, "reason": reason},
    )
    session.flush()
    return flag


def pause_flag(session: Session) -> ControlFlag | None:
    """The pause switch as last set (who, when, why), or None if nobody ever set it."""
    return session.get(ControlFlag, PAUSE_FLAG)


def is_paused(session: Session) -> bool:
    flag = pause_flag(session)
    return flag is not None and flag.value


def cursors(session: Session) -> list[Cursor]:
    """Every watcher's cursor: where its last poll ended, and when it wrote that."""
    return list(session.scalars(select(Cursor).order_by(Cursor.name)))
