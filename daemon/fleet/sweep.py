"""A sweep: probe nodes (the prober's fan-out), judge each for the fleet, record the check,
and act on policy: drain, or return a node slurm-medic drained for a pending remap.

The I/O edge of the fleet stage: Slurm (node states, running jobs, drain, resume) through the
backend, the nodes through the prober, the record through the store. Every check is on the
record before anything is done about it, and each drain or resume is an action row (written
before the command runs) and a node event naming who, why, on what finding, and the check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial

from sqlalchemy.orm import Session

from daemon.config import Settings
from daemon.effects import Performed, perform
from daemon.evidence.nvidia_smi import MIB
from daemon.evidence.prober import NodeProber, ProbeRequest
from daemon.evidence.records import ProbeVerdict
from daemon.fleet.findings import CORDON_FINDING, NodeJudgement, gres_gpu_count, judge_node
from daemon.fleet.node_policy import (
    DrainInForce,
    NodeDecision,
    NodeDecisionKind,
    NodeFacts,
    PastCheck,
    decide_node,
    resume_decision,
)
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.hostlist import expand_hostlist
from daemon.slurm.records import SlurmJob, SlurmNode
from daemon.slurm.scontrol import drain_argv, resume_argv
from daemon.store import control, node_records
from daemon.store import service_records as records
from daemon.store.models import ActionKind, CheckTrigger, NodeEvent, NodeEventKind
from daemon.store.repository import Actor

log = logging.getLogger(__name__)

BREAKER_WINDOW = timedelta(hours=1)


@dataclass(frozen=True)
class SweepDeps:
    settings: Settings
    backend: SlurmBackend
    prober: NodeProber
    clock: Callable[[], datetime]
    actor: Actor


@dataclass(frozen=True)
class SweepTarget:
    """One node to check, why, and from when its kernel log counts (None: all of it)."""

    node: str
    trigger: CheckTrigger
    window_start: datetime | None = None
    after_job_id: int | None = None


@dataclass(frozen=True)
class SweptNode:
    """One node's check: the judgement, the decision, and what was done (None: nothing)."""

    judgement: NodeJudgement
    decision: NodeDecision
    check_id: int
    done: str | None = None


def sweep_nodes(slurm_nodes: Iterable[SlurmNode], hostlist: str | None) -> list[str]:
    """The nodes a sweep covers: the hostlist's, else every node whose gres names GPUs."""
    if hostlist is not None:
        return list(expand_hostlist(hostlist))
    return [node.name for node in slurm_nodes if gres_gpu_count(node.gres)]


def running_by_node(jobs: Iterable[SlurmJob]) -> dict[str, tuple[int, ...]]:
    found: dict[str, list[int]] = {}
    for job in jobs:
        for node in job.nodes:
            found.setdefault(node, []).append(job.job_id)
    return {node: tuple(ids) for node, ids in found.items()}


def sweep(
    session: Session,
    deps: SweepDeps,
    targets: Sequence[SweepTarget],
    *,
    act: bool,
    slurm_nodes: Sequence[SlurmNode] | None = None,
) -> list[SweptNode]:
    """Probe the targets at once, then judge, record and decide each in turn. With `act` off
    a drain policy would make is recorded as held, and nothing is resumed. `slurm_nodes`: the
    nodes as Slurm showed them this moment, when the caller has just asked."""
    if not targets:
        return []
    settings = deps.settings
    shown = deps.backend.nodes() if slurm_nodes is None else slurm_nodes
    slurm = {node.name: node for node in shown}
    running = running_by_node(deps.backend.running_jobs())
    probes = deps.prober.probe_many(
        [ProbeRequest(target.node, target.window_start) for target in targets], fresh=True
    )
    in_force = {event.node: event for event in control.drains_in_force(session)}
    drains = records.drains_since(session, since=deps.clock() - BREAKER_WINDOW)
    paused = control.is_paused(session)
    catalog = deps.prober.catalog
    cotenant_min = settings.probe.cotenant_min_mib * MIB if settings.probe else 1024 * MIB
    session.commit()
    results = []
    for target, probe in zip(targets, probes, strict=True):
        node = slurm.get(target.node)
        judgement = judge_node(
            probe,
            catalog=catalog,
            gpus_expected=gres_gpu_count(node.gres if node else None),
            running_jobs=running.get(target.node, ()),
            cotenant_min_bytes=cotenant_min,
        )
        facts = NodeFacts(node, target.node in in_force, drains, paused)
        decision = decide_node(judgement, facts, sweep=settings.sweep, policy=settings.policy)
        if decision.drains and not act:
            decision = replace(
                decision,
                kind=NodeDecisionKind.HELD,
                reason=f"would {decision.kind.value} ({decision.reason}); not asked to drain",
            )
        check = node_records.record_check(
            session,
            judgement,
            trigger=target.trigger,
            decision=decision.kind.value,
            decision_reason=decision.reason,
            actor_name=deps.actor.name,
            after_job_id=target.after_job_id,
        )
        held = in_force.get(target.node)
        if held is not None and not decision.drains:
            decision = _resume_decision(session, held, node, deps)
            check.decision, check.decision_reason = decision.kind.value, decision.reason
        session.commit()
        done = None
        if decision.drains:
            done = drain_node(session, target.node, decision, check.id, deps)
            drains += done == "drained"
        elif decision.kind is NodeDecisionKind.RESUME and act:
            done = resume_node(session, target.node, decision.reason, check.id, deps)
        log.info(
            "node checked",
            extra={
                "fields": {
                    "node": target.node,
                    "trigger": target.trigger.value,
                    "health": judgement.health.value,
                    "deciding": judgement.deciding,
                    "decision": decision.kind.value,
                    "done": done,
                }
            },
        )
        results.append(SweptNode(judgement, decision, check.id, done))
    return results


def _resume_decision(
    session: Session, held: NodeEvent, node: SlurmNode | None, deps: SweepDeps
) -> NodeDecision:
    after = held.check_id or node_records.check_before(session, held.node, at=held.occurred_at)
    since = [
        PastCheck(ProbeVerdict(row.health), row.deciding)
        for row in node_records.checks_after(session, held.node, after_id=after)
    ]
    # An incident's drain and a sweep's (the daemon's or `sweep --drain`'s) are policy's; a
    # cordon is a person's.
    drain = DrainInForce(by_daemon=held.finding != CORDON_FINDING, finding=held.finding)
    return resume_decision(drain, since, node, sweep=deps.settings.sweep)


def change_node(
    session: Session,
    backend: SlurmBackend,
    actor: Actor,
    *,
    node: str,
    kind: NodeEventKind,
    reason: str,
    check_id: int | None,
    finding: str | None = None,
) -> Performed:
    """Drain (with a `medic:` reason) or resume a node: the action row written before the
    command runs, then, if Slurm did it, the node event naming who, why, on what finding and
    the check. The backend refuses to overwrite or clear a drain someone else set."""
    if kind is NodeEventKind.DRAIN:
        argv, run = drain_argv(node, reason), partial(backend.drain, node, reason)
    else:
        argv, run = resume_argv(node), partial(backend.resume, node)
    done = perform(session, kind=ActionKind(kind.value), argv=argv, actor=actor, run=run, node=node)
    if done.error is None:
        control.record_node_event(
            session,
            node=node,
            kind=kind,
            by_medic=True,
            reason=reason,
            action_id=done.action.id,
            actor_name=actor.name,
            finding=finding,
            check_id=check_id,
        )
        session.commit()
    return done


def drain_node(
    session: Session, node: str, decision: NodeDecision, check_id: int, deps: SweepDeps
) -> str:
    """Drain with the decision's `medic:` reason; what was done, or why not."""
    reason = decision.drain_reason
    assert reason is not None, "a drain decision carries its Slurm reason"
    done = change_node(
        session,
        deps.backend,
        deps.actor,
        node=node,
        kind=NodeEventKind.DRAIN,
        reason=reason,
        check_id=check_id,
        finding=decision.finding.value if decision.finding else None,
    )
    return "drained" if done.error is None else f"not drained: {done.error}"


def resume_node(session: Session, node: str, reason: str, check_id: int, deps: SweepDeps) -> str:
    """Resume a node slurm-medic drained; what was done, or why not."""
    done = change_node(
        session,
        deps.backend,
        deps.actor,
        node=node,
        kind=NodeEventKind.RESUME,
        reason=reason,
        check_id=check_id,
    )
    return "resumed" if done.error is None else f"not resumed: {done.error}"
