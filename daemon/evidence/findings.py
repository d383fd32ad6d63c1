"""What the logs of one job say together: the most telling log wins, and only the job's own
nodes may be blamed.

Both readers of job logs use this: the daemon (each ended job's stdout and stderr) and
`slurm-medic diagnose` (the logs a person names). Pure: findings in, findings out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from daemon.evidence.records import LogFindings, RootCause
from daemon.slurm.hostlist import fold_hostlist
from daemon.slurm.records import SlurmJob

# How a note (and a reason) about a node the log names outside the job's allocation begins:
# the log is the job owner's text, and any line of it may name any node.
OUTSIDE_ALLOCATION = "the log names a node outside the job's allocation"


# A root failure that names its cause outright beats another error, which beats a collective
# timeout (the cascade of a failure another log may hold), which beats no failure at all.
_TELLING = {
    RootCause.ACCELERATOR_OOM: 3,
    RootCause.GPU_FAULT: 3,
    RootCause.HOST_RAM: 3,
    RootCause.OTHER_ERROR: 2,
    RootCause.COLLECTIVE_TIMEOUT: 1,
}


def _how_telling(findings: LogFindings) -> tuple[bool, bool, int]:
    telling = 0 if findings.root_cause is None else _TELLING[findings.root_cause]
    names_itself = findings.oom is not None or telling == _TELLING[RootCause.GPU_FAULT]
    return names_itself, findings.root_failure_line is not None, telling


def merge_findings(findings: Sequence[LogFindings]) -> LogFindings:
    """Several logs of one job (stdout and stderr, or one per rank): the most telling wins.

    A log with an OOM report or a root cause that names itself (device memory, a GPU fault,
    host RAM) beats one with only a failure line, which beats one with nothing; the missing
    node and step are then filled from the others.
    """
    if not findings:
        return LogFindings()
    ranked = sorted(findings, key=_how_telling, reverse=True)
    best = ranked[0]
    others = ranked[1:]
    node = best.node or next((f.node for f in others if f.node), None)
    # Step 0 is a step (the first one): fill only a step the best log did not have at all.
    step_from = (
        best if best.step is not None else next((f for f in others if f.step is not None), best)
    )
    steps = [f.max_step_seen for f in findings if f.max_step_seen is not None]
    return dataclasses.replace(
        best,
        node=node,
        step=step_from.step,
        step_line=step_from.step_line,
        max_step_seen=max(steps) if steps else None,
        notes=tuple(note for f in findings for note in f.notes),
        job_pids=tuple(sorted({pid for f in findings for pid in f.job_pids})),
        bytes_scanned=sum(f.bytes_scanned for f in findings),
    )


def confine_to_allocation(findings: LogFindings, job: SlurmJob) -> LogFindings:
    """Only a node the job ran on may be probed or blamed: a node the log names outside the
    job's allocation (a line any rank may print, `srun: error: gpu-09: ...`) is dropped from
    the findings and kept as a note that says so."""
    node = findings.node
    allocation = allocation_nodes(job)
    if node is None or node in allocation:
        return findings
    ran_on = fold_hostlist(sorted(allocation)) if allocation else "nodes Slurm did not report"
    note = f"{OUTSIDE_ALLOCATION}: {node[:64]!a} (the job ran on {ran_on}); not probed or blamed"
    return dataclasses.replace(findings, node=None, notes=(*findings.notes, note))


def allocation_nodes(job: SlurmJob) -> frozenset[str]:
    """The nodes Slurm gave the job (its node list and batch host)."""
    return frozenset(job.nodes) | ({job.batch_host} if job.batch_host else set())
