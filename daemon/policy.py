"""The policy: may this proposal go ahead without a person, and may the daemon act right now?

Pure: facts in (the proposal's lever, whether it changes the science, what was done in the
last hour, the pause switch), a verdict with its reasons out. Two questions, asked at two
moments: `decide` when a proposal is made (approve it, or wait for a person), and `gate`
just before acting on an approved one (pause, dry run, rate limits, the drain circuit
breaker). An approved proposal held by the gate stays approved and is tried again later.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from daemon.config import PolicySettings


class Decision(StrEnum):
    AUTO_APPROVE = "auto_approve"
    WAIT_FOR_PERSON = "wait_for_person"


@dataclass(frozen=True)
class ProposalFacts:
    """What the policy needs to know about a proposal, nothing more."""

    remediator: str
    changes_science: bool
    drains: tuple[str, ...] = ()  # nodes the proposal would drain
    managed: bool = True  # False: matched for diagnosis only; never relaunched


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reasons: tuple[str, ...]

    @property
    def approved(self) -> bool:
        return self.decision is Decision.AUTO_APPROVE


def decide(facts: ProposalFacts, settings: PolicySettings) -> Verdict:
    """Approve a proposal without a person only when every rule allows it, and say why not."""
    reasons: list[str] = []
    if not facts.managed:
        reasons.append("the job belongs to no lineage: diagnosed for the record, never relaunched")
    if facts.changes_science:
        reasons.append(f"{facts.remediator} changes the science: a person must approve it")
    if facts.remediator not in settings.auto_approve:
        reasons.append(f"{facts.remediator} is not in policy.auto_approve")
    if reasons:
        return Verdict(Decision.WAIT_FOR_PERSON, tuple(reasons))
    return Verdict(
        Decision.AUTO_APPROVE,
        (f"{facts.remediator} is in policy.auto_approve and leaves the science unchanged",),
    )


class Hold(StrEnum):
    """Why an approved proposal is not acted on now."""

    PAUSED = "paused"
    DRY_RUN = "dry_run"
    USER_RATE = "user_rate"
    CLUSTER_RATE = "cluster_rate"
    DRAIN_BREAKER = "drain_breaker"


@dataclass(frozen=True)
class RecentActivity:
    """What slurm-medic did in the last hour, counted from the record."""

    relaunches_by_user: int
    relaunches: int
    drains: int


@dataclass(frozen=True)
class GateVerdict:
    """Act now (`holds` empty), or why not yet; `drop_drains` lists drains the breaker refuses
    while the relaunch may still go ahead excluding those nodes."""

    holds: tuple[Hold, ...]
    reasons: tuple[str, ...]
    drop_drains: tuple[str, ...] = ()

    @property
    def may_act(self) -> bool:
        return not self.holds


def gate(
    facts: ProposalFacts,
    activity: RecentActivity,
    settings: PolicySettings,
    *,
    paused: bool,
) -> GateVerdict:
    """Whether to act on an approved proposal now. A drain over the breaker's budget is left
    out (the node is still excluded from the relaunch), never the whole relaunch."""
    holds: list[Hold] = []
    reasons: list[str] = []
    if paused or settings.paused:
        holds.append(Hold.PAUSED)
        reasons.append("slurm-medic is paused: proposals are recorded, nothing is acted on")
    if settings.dry_run:
        holds.append(Hold.DRY_RUN)
        reasons.append("dry-run mode: proposals only")
    if activity.relaunches_by_user >= settings.max_relaunches_per_user_per_hour:
        holds.append(Hold.USER_RATE)
        reasons.append(
            f"this user had {activity.relaunches_by_user} relaunches in the last hour "
            f"(limit {settings.max_relaunches_per_user_per_hour})"
        )
    if activity.relaunches >= settings.max_relaunches_per_hour:
        holds.append(Hold.CLUSTER_RATE)
        reasons.append(
            f"{activity.relaunches} relaunches cluster-wide in the last hour "
            f"(limit {settings.max_relaunches_per_hour})"
        )
    room = max(0, settings.max_drains_per_hour - activity.drains)
    dropped = facts.drains[room:]
    if dropped:
        reasons.append(
            f"drain circuit breaker: {activity.drains} drain(s) in the last hour "
            f"(limit {settings.max_drains_per_hour}); not draining {', '.join(dropped)}, "
            "only excluding it"
        )
    return GateVerdict(tuple(holds), tuple(reasons), tuple(dropped))
