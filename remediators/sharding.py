"""Optimizer-state sharding up: Megatron's distributed optimizer, ZeRO stage + 1, or torchrun's
sharded optimizer. The first move for optimizer bursts and for optimizer state that appears
after step 1. The math is identical; only where the state lives changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.diagnosis import Diagnosis, FailureKind
from daemon.dialects.base import KnobKind, Role
from daemon.imported import invariant_terms
from daemon.templates.model import LaunchTemplate
from remediators.base import (
    Applicability,
    Cost,
    Lever,
    RemediationProposal,
    change,
    int_knob,
    no,
    not_managed,
    require,
    yes,
)
from remediators.micro_batch import why_it_ran_out

_ZERO_COST = {1: (0, 5), 2: (5, 10), 3: (10, 25)}


@dataclass(frozen=True)
class ShardingUp:
    name: str = "sharding_up"
    lever: Lever = Lever.SHARDING

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = template.dialect.knob_for(Role.SHARDING)
        if knob is None:
            return no(f"dialect {template.dialect.name} has no optimizer-sharding knob")
        # The data-parallel size it shards over comes from the whole batch geometry.
        if (refused := not_managed(template, knob, *invariant_terms(template.dialect))) is not None:
            return refused
        spec = template.dialect.spec(knob)
        value = template.knobs[knob]
        if spec.kind is KnobKind.BOOL and value is True:
            return no(f"{knob} is already on")
        if spec.kind is KnobKind.INT and int_knob(template.knobs, knob) >= (spec.maximum or 0):
            return no(f"{knob} is already at its highest stage")
        geometry = template.dialect.geometry(template.knobs)
        if geometry.data_parallel < 2:
            return no("one data-parallel rank: there is nobody to shard optimizer state with")
        return yes(f"optimizer state can be split across {geometry.data_parallel} ranks")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        dialect, knobs = template.dialect, template.knobs
        knob = dialect.roles[Role.SHARDING]
        data_parallel = dialect.geometry(knobs).data_parallel
        if dialect.spec(knob).kind is KnobKind.BOOL:
            after: bool | int = True
            low, high = 0, 5
            what = f"{knob} on: Adam state split {data_parallel} ways (ZeRO-1)"
        else:
            after = int_knob(knobs, knob) + 1
            low, high = _ZERO_COST[after]
            what = f"{knob} {knobs[knob]} -> {after}"
        if diagnosis.kind is FailureKind.OPTIMIZER_BURST:
            why = "Optimizer burst: the OOM happened inside optimizer.step"
        else:
            why = f"True OOM: the job {why_it_ran_out(diagnosis)}"
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(knobs, knob, after),),
            rationale=f"{why}. {what}.",
            expected_effect=f"optimizer state per GPU falls to about 1/{data_parallel}",
            cost=Cost((low, high), "extra gather/reduce-scatter communication"),
            changes_science=False,
        )


@dataclass(frozen=True)
class EightBitOptimizer:
    """An 8-bit optimizer changes numerics: offered, never applied without a person."""

    name: str = "optimizer_8bit"
    lever: Lever = Lever.OPTIMIZER

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = template.dialect.knob_for(Role.OPTIMIZER)
        if knob is None:
            return no(f"dialect {template.dialect.name} has no optimizer knob")
        if (refused := not_managed(template, knob)) is not None:
            return refused
        if "8bit" in str(template.knobs[knob]):
            return no("the optimizer is already 8-bit")
        if "adamw_8bit" not in template.dialect.spec(knob).choices:
            return no("no 8-bit optimizer among the choices")
        return yes("Adam moments can be stored in 8 bits")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.OPTIMIZER]
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, "adamw_8bit"),),
            rationale=(
                f"Optimizer state does not fit and it cannot be sharded further. {knob} "
                f"{template.knobs[knob]} -> adamw_8bit stores both Adam moments in 8 bits."
            ),
            expected_effect="optimizer state shrinks about 4x",
            cost=Cost((0, 5), "needs bitsandbytes; different optimizer numerics"),
            changes_science=True,
        )
