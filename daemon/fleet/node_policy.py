"""What to do about a node a sweep judged: drain now, drain after the running job, record only;
and when a node slurm-medic drained may go back to service.

Pure: the judgement, what Slurm and the record say of the node, and the settings in; a
decision with its reason out. Etiquette first: a drain someone else set is never touched, a
node already held drained is not drained twice, and the circuit breaker counts every drain of
the last hour, the incidents' and the sweep's together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from daemon.config import PolicySettings, SweepSettings
from daemon.evidence.records import FindingKind, ProbeVerdict
from daemon.fleet.findings import CORDON_FINDING, Finding, NodeJudgement
from daemon.slurm.records import MEDIC_REASON_PREFIX, SlurmNode

MAX_REASON_CHARS = 200


class NodeDecisionKind(StrEnum):
    DRAIN_NOW = "drain_now"
    DRAIN_AFTER_JOB = "drain_after_job"
    RECORD = "record"  # nothing policy drains for, or nothing found
    ALREADY_DRAINED = "already_drained"  # slurm-medic holds it drained already
    DRAINED_BY_OTHER = "drained_by_other"  # someone else's drain: never touched
    HELD = "held"  # policy would drain, but the breaker, the pause or dry-run holds it
    RESUME = "resume"
    KEEP_DRAINED = "keep_drained"  # a slurm-medic drain that does not return (yet)


DRAINS = frozenset({NodeDecisionKind.DRAIN_NOW, NodeDecisionKind.DRAIN_AFTER_JOB})


@dataclass(frozen=True)
class NodeDecision:
    kind: NodeDecisionKind
    reason: str
    finding: FindingKind | None = None
    drain_reason: str | None = None  # what Slurm's Reason= says, `medic: ...`

    @property
    def drains(self) -> bool:
        return self.kind in DRAINS


@dataclass(frozen=True)
class NodeFacts:
    """What the record and Slurm say of the node beside the probe."""

    slurm: SlurmNode | None  # None: Slurm did not list it
    medic_drain_in_force: bool
    drains_last_hour: int
    paused: bool


def slurm_reason(text: str) -> str:
    """`medic: TEXT` as one printable line Slurm keeps whole."""
    words = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return f"{MEDIC_REASON_PREFIX} {words}"[:MAX_REASON_CHARS]


def decide_node(
    judgement: NodeJudgement,
    facts: NodeFacts,
    *,
    sweep: SweepSettings,
    policy: PolicySettings,
) -> NodeDecision:
    """Drain now, after the job, or record only; then whether etiquette or the breaker holds it."""
    chosen = _drain_finding(judgement.findings, sweep)
    if chosen is None:
        if judgement.health is ProbeVerdict.HEALTHY:
            return NodeDecision(NodeDecisionKind.RECORD, "healthy")
        kinds = ", ".join(judgement.kinds())
        return NodeDecision(NodeDecisionKind.RECORD, f"policy drains for none of: {kinds}")
    finding, kind = chosen
    # Slurm says whether the drain still holds (a person may have resumed the node or
    # rewritten the reason since); the record speaks only for a node Slurm did not list.
    held = facts.slurm.drained_by_medic if facts.slurm is not None else facts.medic_drain_in_force
    if held:
        return NodeDecision(
            NodeDecisionKind.ALREADY_DRAINED, "slurm-medic holds it drained already", finding.kind
        )
    if facts.slurm is not None and facts.slurm.is_drained:
        by = facts.slurm.reason_user or "someone else"
        return NodeDecision(
            NodeDecisionKind.DRAINED_BY_OTHER,
            f"already drained by {by} ({facts.slurm.reason or 'no reason'}): left as it is",
            finding.kind,
        )
    if facts.paused or policy.paused:
        return NodeDecision(NodeDecisionKind.HELD, "slurm-medic is paused", finding.kind)
    if policy.dry_run:
        return NodeDecision(
            NodeDecisionKind.HELD, f"dry-run mode: would {kind.value}", finding.kind
        )
    if facts.drains_last_hour >= policy.max_drains_per_hour:
        return NodeDecision(
            NodeDecisionKind.HELD,
            f"drain circuit breaker: {facts.drains_last_hour} drain(s) in the last hour "
            f"(limit {policy.max_drains_per_hour}); not draining",
            finding.kind,
        )
    jobs = judgement.running_jobs
    if kind is NodeDecisionKind.DRAIN_AFTER_JOB and jobs:
        reason = f"{finding.kind.value}: drained after job(s) {', '.join(map(str, jobs))} end"
    elif kind is NodeDecisionKind.DRAIN_AFTER_JOB:
        reason = f"{finding.kind.value}: no job runs there, drained at once"
    else:
        reason = f"{finding.kind.value}: drained now"
    return NodeDecision(kind, reason, finding.kind, slurm_reason(f"sweep: {finding.text}"))


def _drain_finding(
    findings: Sequence[Finding], sweep: SweepSettings
) -> tuple[Finding, NodeDecisionKind] | None:
    """The first finding policy drains for now, else the first it drains for after the job."""
    for finding in findings:
        if finding.kind in sweep.drain_now:
            return finding, NodeDecisionKind.DRAIN_NOW
    for finding in findings:
        if finding.kind in sweep.drain_after_job:
            return finding, NodeDecisionKind.DRAIN_AFTER_JOB
    return None


@dataclass(frozen=True)
class DrainInForce:
    """A slurm-medic drain not undone since: who set it and on what finding."""

    by_daemon: bool
    finding: str | None


@dataclass(frozen=True)
class PastCheck:
    """A check on the record, as much of it as the return to service reads."""

    health: ProbeVerdict
    deciding: str


def resume_decision(
    drain: DrainInForce,
    since_drain: Sequence[PastCheck],
    slurm: SlurmNode | None,
    *,
    sweep: SweepSettings,
) -> NodeDecision:
    """A node slurm-medic drained returns only if its own sweep drained it for a pending remap,
    the remap was applied (a reset or reboot cleared it) and `resume_after_healthy` checks in a
    row since were healthy, and policy allows it; else it waits for an admin. Never a drain
    whose reason is no longer slurm-medic's."""
    wanted = sweep.resume_after_healthy
    if slurm is None or not slurm.drained_by_medic:
        reason = "Slurm no longer shows slurm-medic's drain: someone else holds the node"
        return NodeDecision(NodeDecisionKind.KEEP_DRAINED, reason)
    if drain.finding == CORDON_FINDING or not drain.by_daemon:
        return NodeDecision(
            NodeDecisionKind.KEEP_DRAINED, "a person's cordon: only an admin resumes it"
        )
    if drain.finding != FindingKind.REMAP_PENDING.value:
        return NodeDecision(
            NodeDecisionKind.KEEP_DRAINED,
            f"drained for {drain.finding or 'an incident'}: only a pending-remap drain returns"
            " by itself; an admin resumes it",
        )
    if not sweep.auto_resume:
        return NodeDecision(
            NodeDecisionKind.KEEP_DRAINED, "sweep.auto_resume is off: an admin resumes it"
        )
    streak = 0
    for judgement in reversed(since_drain):
        if judgement.health is not ProbeVerdict.HEALTHY:
            break
        streak += 1
    if streak < wanted:
        latest = since_drain[-1].deciding if since_drain else "not probed since the drain"
        return NodeDecision(
            NodeDecisionKind.KEEP_DRAINED,
            f"{streak} of {wanted} healthy sweeps in a row since the drain (latest: {latest})",
        )
    return NodeDecision(
        NodeDecisionKind.RESUME,
        f"the pending remap was applied and {streak} sweeps in a row found the node healthy",
    )
