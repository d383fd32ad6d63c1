"""The daemon's sweep: each node at its moment of the interval, and each node right after a job
on it ends, as Slurm's epilog health checks do.

Which nodes are due comes from the record (each node's last check) and two cursors: when the
sweep started (a first start spreads the fleet over the interval instead of probing it all
at once) and how far the ended jobs have been read. A node due on both counts is probed
once; its kernel log is read from its previous check on (or from the job's start).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from daemon.fleet.schedule import due_nodes
from daemon.fleet.sweep import SweepDeps, SweepTarget, SweptNode, sweep, sweep_nodes
from daemon.slurm.records import JobState, SlurmNode
from daemon.store import control, node_records
from daemon.store.models import CheckTrigger

STARTED_CURSOR = "fleet_sweep_started"
AFTER_JOB_CURSOR = "fleet_sweep_after_job"
# Accounting writes a job's end a few seconds late: each read of ended jobs overlaps the last.
AFTER_JOB_OVERLAP = timedelta(seconds=120)
# Every way a job ends that sacct can select on (it refuses REVOKED and SPECIAL_EXIT).
ENDED_STATES = (
    JobState.COMPLETED,
    JobState.CANCELLED,
    JobState.FAILED,
    JobState.TIMEOUT,
    JobState.NODE_FAIL,
    JobState.PREEMPTED,
    JobState.BOOT_FAIL,
    JobState.DEADLINE,
    JobState.OUT_OF_MEMORY,
)


def scheduled_targets(
    session: Session, deps: SweepDeps, slurm_nodes: Sequence[SlurmNode], *, now: datetime
) -> list[SweepTarget]:
    """The nodes due now by the schedule, then the nodes of jobs that ended since the last look."""
    settings = deps.settings.sweep
    interval = timedelta(seconds=settings.interval_s)
    nodes = sweep_nodes(slurm_nodes, settings.nodes)
    started = control.get_cursor(session, name=STARTED_CURSOR)
    if started is None:
        started = now
        control.set_cursor(session, name=STARTED_CURSOR, polled_until=now)
    last = node_records.last_checked(session, nodes)
    targets = [
        SweepTarget(node, CheckTrigger.SCHEDULE, window_start=last.get(node, now - interval))
        for node in due_nodes(nodes, last, now=now, interval_s=settings.interval_s, started=started)
    ]
    if not settings.after_job:
        return targets
    chosen = {target.node for target in targets}
    read_until = control.get_cursor(session, name=AFTER_JOB_CURSOR) or now
    window = deps.backend.finished_window(read_until - AFTER_JOB_OVERLAP, now, states=ENDED_STATES)
    covered = set(nodes)
    for job in sorted(window.jobs, key=lambda job: (job.end_time or now, job.job_id)):
        ended = job.end_time or now
        for node in job.nodes:
            if node not in covered or node in chosen:
                continue
            if node in last and last[node] >= ended:
                continue  # checked since this job ended
            chosen.add(node)
            targets.append(
                SweepTarget(
                    node,
                    CheckTrigger.AFTER_JOB,
                    window_start=job.start_time or ended,
                    after_job_id=job.job_id,
                )
            )
    control.set_cursor(session, name=AFTER_JOB_CURSOR, polled_until=now)
    return targets


def run_scheduled_sweep(session: Session, deps: SweepDeps) -> list[SweptNode]:
    """One cycle's share of the sweep: the due nodes probed together, judged, acted on."""
    slurm_nodes = deps.backend.nodes()  # once a cycle: whom to sweep, and their state
    targets = scheduled_targets(session, deps, slurm_nodes, now=deps.clock())
    session.commit()
    return sweep(session, deps, targets, act=True, slurm_nodes=slurm_nodes)
