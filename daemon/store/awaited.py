"""The managed jobs whose end accounting has not recorded yet, and the finished-job cursor's
hold: what `status` shows as records in flight.

A lineage job is known by its id from its sbatch; once it has left slurmctld's queue it is
looked up by that id each poll until accounting has its final record (`AwaitedRecord` says
since when, and what accounting showed at the last look), so no managed failure depends on a
poll window's timing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from daemon.store.models import AwaitedRecord, Cursor, Lineage
from daemon.store.service_records import handled_job_ids, lineage_job_ids, rejected_job_ids


def unhandled_lineage_jobs(session: Session) -> dict[int, int]:
    """Job id -> lineage id for each job of an active lineage not handled yet, nor skipped
    for a record no parser could read (that is on the record already)."""
    jobs = lineage_job_ids(session)
    done = handled_job_ids(session, slurm_job_ids=jobs)
    done |= rejected_job_ids(session, slurm_job_ids=set(jobs) - done)
    return {job_id: lineage for job_id, lineage in jobs.items() if job_id not in done}


def awaited(session: Session) -> dict[int, AwaitedRecord]:
    return {row.slurm_job_id: row for row in session.scalars(select(AwaitedRecord))}


def note_awaited(
    session: Session,
    *,
    slurm_job_id: int,
    lineage_id: int,
    now: datetime,
    accounting: str,
) -> AwaitedRecord:
    """One more look at a job that has left the queue without a final record."""
    row = session.get(AwaitedRecord, slurm_job_id)
    if row is None:
        row = AwaitedRecord(
            slurm_job_id=slurm_job_id,
            lineage_id=lineage_id,
            left_queue_at=now,
            looked_at=now,
            looks=0,
            accounting=accounting,
        )
        session.add(row)
    row.looked_at = now
    row.looks += 1
    row.accounting = accounting[:500]
    session.flush()
    return row


def forget_awaited(session: Session, slurm_job_ids: Iterable[int]) -> None:
    """These jobs are handled, back in the queue, or no longer a lineage's to wait for."""
    ids = list(slurm_job_ids)
    for start in range(0, len(ids), 500):
        session.execute(
            delete(AwaitedRecord).where(AwaitedRecord.slurm_job_id.in_(ids[start : start + 500]))
        )
    session.flush()


@dataclass(frozen=True)
class InFlight:
    """What accounting may still be missing, for `status` and the metrics."""

    held: list[Cursor]
    awaited: list[tuple[AwaitedRecord, str]]  # with the lineage's owner


def in_flight(session: Session) -> InFlight:
    held = list(
        session.scalars(select(Cursor).where(Cursor.held_since.is_not(None)).order_by(Cursor.name))
    )
    rows = session.execute(
        select(AwaitedRecord, Lineage.owner)
        .join(Lineage, Lineage.id == AwaitedRecord.lineage_id)
        .order_by(AwaitedRecord.left_queue_at, AwaitedRecord.slurm_job_id)
    ).tuples()
    return InFlight(held, [(row, owner) for row, owner in rows])
