"""The remediation ladder: which fix to propose next for a lineage, or why to stop and ask.

Pure: diagnosis, template (as it stood when the job died), lineage history and policy in;
a `Proposal` or a `Refusal` out, with every skipped rung and the reason it was skipped. It
imports no subprocess, SSH or SQL, and counts nothing: the orchestrator records attempts.

Hard rules, checked again after the ladder so a wrong ladder cannot break them: no blind batch
cut on fragmentation, no allocator change on a true OOM, and never a patch that leads back to a
config that already died in this lineage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from daemon.diagnosis import Diagnosis, FailureKind, MidRunCause, Onset
from daemon.dialects.base import Knobs, KnobValue
from daemon.templates.model import LaunchTemplate, TemplateError
from daemon.templates.rendering import render
from daemon.templates.revisions import Patch
from remediators.base import Lever, NodeAction, NodeActionKind, RemediationProposal, Remediator
from remediators.registry import BY_NAME

_PRECISION_LADDER = (
    "micro_batch_down",
    "recompute_selective",
    "recompute_full",
    "sharding_up",
    "sequence_length_down",
)

# Cheapest first, per kind (the runbook's first moves). Names refer to remediators.registry.
LADDERS: Mapping[FailureKind, tuple[str, ...]] = {
    FailureKind.HARDWARE: ("drain_and_exclude", "exclude_node"),
    FailureKind.COTENANT: ("exclude_node",),
    FailureKind.HOST_RAM: ("dataloader_workers_down",),
    FailureKind.FRAGMENTATION: (
        "allocator_expandable_segments",
        "allocator_max_split_size",
        "allocator_gc_threshold",
    ),
    FailureKind.TRUE_OOM: _PRECISION_LADDER,
    FailureKind.WORKSPACE_SPIKE: (
        "recompute_selective",
        "micro_batch_down",
        "sequence_length_down",
    ),
    FailureKind.OPTIMIZER_BURST: ("sharding_up", "optimizer_8bit"),
    FailureKind.EVAL_GROWTH: ("eval_batch_down", "eval_accumulation", "eval_generation_cap"),
    FailureKind.NOT_OOM: (),
    FailureKind.UNKNOWN: (),
}

# Optimizer state that appeared after the first steps is a sharding problem before a batch one.
_OPTIMIZER_STATE_LADDER = (
    "sharding_up",
    "micro_batch_down",
    "recompute_selective",
    "recompute_full",
    "sequence_length_down",
)

# Levers a kind must never pull, whatever a ladder says.
FORBIDDEN: Mapping[FailureKind, frozenset[Lever]] = {
    FailureKind.FRAGMENTATION: frozenset({Lever.BATCH, Lever.SEQUENCE}),
    FailureKind.TRUE_OOM: frozenset({Lever.ALLOCATOR}),
    FailureKind.COTENANT: frozenset({Lever.BATCH, Lever.SEQUENCE}),
    FailureKind.HARDWARE: frozenset({Lever.BATCH, Lever.SEQUENCE, Lever.ALLOCATOR}),
    FailureKind.HOST_RAM: frozenset(
        {Lever.BATCH, Lever.RECOMPUTE, Lever.SHARDING, Lever.SEQUENCE, Lever.ALLOCATOR}
    ),
}


class Outcome(StrEnum):
    """How an attempt's relaunch ended."""

    PENDING = "pending"
    VERIFIED = "verified"
    SAME_FAILURE = "same_failure"
    DIFFERENT_FAILURE = "different_failure"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Attempt:
    """One rung tried in a lineage: what it changed, and how far the relaunch got."""

    remediator: str
    rung: int
    kind: FailureKind
    knobs_before: Mapping[str, KnobValue]
    knobs_after: Mapping[str, KnobValue]
    outcome: Outcome
    failing_step: int | None = None  # the step the failure it answered happened at
    step_reached: int | None = None  # the furthest step its relaunch logged

    @property
    def made_progress(self) -> bool:
        """False when the relaunch failed again without getting past the step that failed."""
        if self.outcome is not Outcome.SAME_FAILURE:
            return True
        if self.failing_step is None or self.step_reached is None:
            return True
        return self.step_reached > self.failing_step


@dataclass(frozen=True)
class LineageHistory:
    """A run's attempts so far, oldest first."""

    attempts: tuple[Attempt, ...] = ()


@dataclass(frozen=True)
class PlannerPolicy:
    """Retry budgets: per lineage, per rule (overridable per remediator), and for no progress."""

    max_attempts_per_lineage: int = 6
    max_attempts_per_rule: int = 1
    per_rule: Mapping[str, int] = field(default_factory=dict)
    max_no_progress: int = 2

    def rule_budget(self, remediator: str) -> int:
        return self.per_rule.get(remediator, self.max_attempts_per_rule)


@dataclass(frozen=True)
class SkippedRung:
    rung: int
    remediator: str
    reason: str


@dataclass(frozen=True)
class Proposal:
    """The next fix: a typed patch, the words to approve it, and what was passed over."""

    kind: FailureKind
    rung: int
    ladder: tuple[str, ...]
    remediation: RemediationProposal
    patch: Patch
    knobs_after: Mapping[str, KnobValue]
    skipped: tuple[SkippedRung, ...]

    @property
    def requires_person(self) -> bool:
        return self.remediation.changes_science


@dataclass(frozen=True)
class Refusal:
    """No fix to propose: why, what was considered, and that a person must look."""

    kind: FailureKind
    reason: str
    skipped: tuple[SkippedRung, ...] = ()
    asks_person: bool = True


@dataclass(frozen=True)
class PlannedFix:
    """A proposal as the record keeps it, written once when it is made: everything acting on
    it, judging its relaunch and counting it as an attempt needs. Stored through the codec;
    a field missing from a stored one is an error, never a default."""

    remediator: str
    lever: Lever
    kind: FailureKind
    rung: int
    ladder: tuple[str, ...]
    patch: Patch
    expected_effect: str
    cost: str  # in words (`Cost.describe`); the proposal row keeps the number people sort by
    knobs_before: Mapping[str, KnobValue]
    knobs_after: Mapping[str, KnobValue]
    failing_step: int | None  # the step its relaunch must get past
    actions: tuple[NodeAction, ...]
    skipped: tuple[SkippedRung, ...]

    @property
    def drains(self) -> tuple[str, ...]:
        return tuple(a.node for a in self.actions if a.kind is NodeActionKind.DRAIN)


@dataclass(frozen=True)
class AttemptRecord:
    """The planner's memory of one proposal: the fix as planned, the revision its relaunch
    runs and the checkpoint step it resumed from (once acted on), and how it ended."""

    fix: PlannedFix
    revision_id: int | None
    resumed_step: int | None
    outcome: Outcome
    step_reached: int | None  # the furthest step its relaunch logged, once judged


def planned_fix(
    proposal: Proposal, knobs_before: Mapping[str, KnobValue], failing_step: int | None
) -> PlannedFix:
    """The record of a proposal as it is made."""
    remediation = proposal.remediation
    return PlannedFix(
        remediator=remediation.remediator,
        lever=remediation.lever,
        kind=proposal.kind,
        rung=proposal.rung,
        ladder=proposal.ladder,
        patch=proposal.patch,
        expected_effect=remediation.expected_effect,
        cost=remediation.cost.describe(),
        knobs_before=dict(knobs_before),
        knobs_after=dict(proposal.knobs_after),
        failing_step=failing_step,
        actions=remediation.actions,
        skipped=proposal.skipped,
    )


def ladder_for(diagnosis: Diagnosis) -> tuple[str, ...]:
    if (
        diagnosis.kind is FailureKind.TRUE_OOM
        and diagnosis.onset is Onset.MID_RUN
        and diagnosis.mid_run_cause is MidRunCause.OPTIMIZER_STATE
    ):
        return _OPTIMIZER_STATE_LADDER
    return LADDERS[diagnosis.kind]


def plan(
    diagnosis: Diagnosis,
    template: LaunchTemplate,
    history: LineageHistory,
    policy: PlannerPolicy,
) -> Proposal | Refusal:
    """The cheapest applicable rung not yet spent in this lineage, or a refusal saying why."""
    kind = diagnosis.kind
    ladder = ladder_for(diagnosis)
    if not ladder:
        return Refusal(kind, f"{kind.value}: not a memory failure slurm-medic can fix; recorded")
    attempts = history.attempts
    if len(attempts) >= policy.max_attempts_per_lineage:
        return Refusal(
            kind, f"the lineage used its budget of {policy.max_attempts_per_lineage} attempts"
        )
    if attempts and attempts[-1].outcome is Outcome.DIFFERENT_FAILURE:
        return Refusal(kind, "the last relaunch failed differently: a person should look first")
    stalled = _trailing_no_progress(attempts)
    if stalled >= policy.max_no_progress:
        return Refusal(
            kind,
            f"{stalled} relaunches in a row did not get past the failing step; retries end here",
        )
    floor = _rung_floor(attempts, ladder) if stalled else 0
    dead_configs = [dict(attempt.knobs_before) for attempt in attempts] + [dict(template.knobs)]
    try:
        current_script = render(template)
    except TemplateError as error:
        return Refusal(kind, f"the lineage's template does not render: {error}")
    skipped: list[SkippedRung] = []
    for rung, name in enumerate(ladder):
        reason = _why_skip(
            rung,
            name,
            floor=floor,
            diagnosis=diagnosis,
            template=template,
            attempts=attempts,
            policy=policy,
            dead_configs=dead_configs,
            current_script=current_script,
        )
        if isinstance(reason, str):
            skipped.append(SkippedRung(rung, name, reason))
            continue
        remediation, patch, knobs_after = reason
        return Proposal(kind, rung, ladder, remediation, patch, knobs_after, tuple(skipped))
    return Refusal(
        kind,
        f"the {kind.value} ladder is exhausted: every rung was tried or does not apply "
        "(see skipped); a person must decide",
        tuple(skipped),
    )


def _trailing_no_progress(attempts: tuple[Attempt, ...]) -> int:
    count = 0
    for attempt in reversed(attempts):
        if attempt.made_progress:
            break
        count += 1
    return count


def _rung_floor(attempts: tuple[Attempt, ...], ladder: tuple[str, ...]) -> int:
    """No progress last time: start above the rung that was just tried."""
    last = attempts[-1]
    if last.remediator in ladder:
        return ladder.index(last.remediator) + 1
    return 0


def _why_skip(
    rung: int,
    name: str,
    *,
    floor: int,
    diagnosis: Diagnosis,
    template: LaunchTemplate,
    attempts: tuple[Attempt, ...],
    policy: PlannerPolicy,
    dead_configs: list[dict[str, KnobValue]],
    current_script: str,
) -> str | tuple[RemediationProposal, Patch, dict[str, KnobValue]]:
    """The reason a rung is passed over, or its proposal when it is the one."""
    if rung < floor:
        return "below the rung that made no progress last time"
    remediator: Remediator = BY_NAME[name]
    if remediator.lever in FORBIDDEN.get(diagnosis.kind, frozenset()):
        return f"never a {remediator.lever.value} change on {diagnosis.kind.value}"
    used = sum(1 for attempt in attempts if attempt.remediator == name)
    if used >= policy.rule_budget(name):
        return f"already tried {used} time(s) in this lineage (budget {policy.rule_budget(name)})"
    applicability = remediator.applies(diagnosis, template)
    if not applicability:
        return applicability.reason
    remediation = remediator.propose(diagnosis, template)
    patch = remediation.patch
    try:
        knobs_after = patch.apply(template.dialect, template.knobs, template.not_managed)
    except TemplateError as error:
        return f"its patch does not apply: {error}"
    if knobs_after in dead_configs:
        return "it leads back to a config that already died in this lineage"
    try:
        script_after = render(template, knobs_after)
    except TemplateError as error:
        return f"its change does not render: {error}"
    if script_after == current_script:
        return "its change would not reach the rendered script"
    return remediation, patch, knobs_after


def attempt_from(proposal: Proposal, template_knobs: Knobs, failing_step: int | None) -> Attempt:
    """The record of a proposal that was acted on, before its outcome is known."""
    return Attempt(
        remediator=proposal.remediation.remediator,
        rung=proposal.rung,
        kind=proposal.kind,
        knobs_before=dict(template_knobs),
        knobs_after=dict(proposal.knobs_after),
        outcome=Outcome.PENDING,
        failing_step=failing_step,
    )


def with_outcome(attempt: Attempt, outcome: Outcome, step_reached: int | None) -> Attempt:
    return dataclasses.replace(attempt, outcome=outcome, step_reached=step_reached)
