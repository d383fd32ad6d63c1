"""A planned fix for tests that seed the record with a proposal the planner did not make."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.diagnosis import FailureKind
from daemon.dialects.base import KnobValue
from daemon.planner import PlannedFix, SkippedRung
from daemon.templates.revisions import KnobChange, Patch
from remediators.base import Lever, NodeAction


def seeded_fix(
    remediator: str = "micro_batch_down",
    changes: Sequence[tuple[str, KnobValue, KnobValue]] = (("micro_batch", 8, 4),),
    *,
    lever: Lever = Lever.BATCH,
    kind: FailureKind = FailureKind.TRUE_OOM,
    reason: str = "halve the micro-batch",
    expected_effect: str = "",
    skipped: tuple[SkippedRung, ...] = (),
    actions: tuple[NodeAction, ...] = (),
    failing_step: int | None = None,
) -> PlannedFix:
    """A fix moving `changes` (knob, before, after); the knobs around them are those moves."""
    return PlannedFix(
        remediator=remediator,
        lever=lever,
        kind=kind,
        rung=0,
        ladder=(remediator,),
        patch=Patch(tuple(KnobChange(*change) for change in changes), reason),
        expected_effect=expected_effect,
        cost="~0% throughput; seeded",
        knobs_before={knob: before for knob, before, _after in changes},
        knobs_after={knob: after for knob, _before, after in changes},
        failing_step=failing_step,
        actions=actions,
        skipped=skipped,
    )
