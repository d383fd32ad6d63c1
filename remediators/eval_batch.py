"""Evaluation memory: a smaller eval batch, and eval outputs moved off the GPU as they come.

Neither touches training; the eval metrics are the same numbers computed in smaller pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.diagnosis import Diagnosis
from daemon.dialects.base import Role
from daemon.templates.model import LaunchTemplate
from remediators.base import (
    Applicability,
    Cost,
    Lever,
    RemediationProposal,
    change,
    explicit_knob,
    human_bytes,
    int_knob,
    no,
    not_managed,
    require,
    yes,
)


def _where(diagnosis: Diagnosis) -> str:
    requested = human_bytes(diagnosis.oom.requested_bytes) if diagnosis.oom else "unknown"
    return (
        f"Eval growth: the OOM happened in {diagnosis.phase.value} at step {diagnosis.step} "
        f"({requested} requested)"
    )


@dataclass(frozen=True)
class EvalBatchDown:
    name: str = "eval_batch_down"
    lever: Lever = Lever.EVAL

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = explicit_knob(template, Role.EVAL_BATCH, "eval batch")
        if isinstance(knob, Applicability):
            return knob
        if int_knob(template.knobs, knob) <= 1:
            return no(f"{knob} is already 1")
        return yes("eval activations and logits scale with the eval batch")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.EVAL_BATCH]
        before = int_knob(template.knobs, knob)
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, before // 2),),
            rationale=f"{_where(diagnosis)}. {knob} {before} -> {before // 2}.",
            expected_effect="eval peak memory roughly halves; training is untouched",
            cost=Cost((0, 0), "eval takes up to twice as many steps"),
            changes_science=False,
        )


@dataclass(frozen=True)
class EvalAccumulation:
    name: str = "eval_accumulation"
    lever: Lever = Lever.EVAL

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = template.dialect.knob_for(Role.EVAL_ACCUM)
        if knob is None:
            return no(f"dialect {template.dialect.name} has no eval accumulation knob")
        if (refused := not_managed(template, knob)) is not None:
            return refused
        if int_knob(template.knobs, knob) == 1:
            return no(f"{knob} is already 1 (outputs leave the GPU every step)")
        return yes("eval outputs pile up on the GPU until the end of evaluation")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.EVAL_ACCUM]
        before = int_knob(template.knobs, knob)
        after = 1 if before == 0 else max(1, before // 2)
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, after),),
            rationale=(
                f"{_where(diagnosis)}. {knob} {before} -> {after}: predictions move to the CPU "
                f"every {after} eval step(s) instead of accumulating on the GPU."
            ),
            expected_effect="eval memory stops growing with the size of the eval set",
            cost=Cost((0, 0), "slower evaluation (device-to-host copies)"),
            changes_science=False,
        )


@dataclass(frozen=True)
class GenerationCap:
    """A lower cap on generated tokens bounds the KV cache; it changes what eval measures."""

    name: str = "eval_generation_cap"
    lever: Lever = Lever.EVAL

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = explicit_knob(template, Role.GENERATION_LENGTH, "generation length")
        if isinstance(knob, Applicability):
            return knob
        if int_knob(template.knobs, knob) < 2:
            return no(f"{knob} is already 1")
        return yes("the KV cache grows with every generated token")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.GENERATION_LENGTH]
        before = int_knob(template.knobs, knob)
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, before // 2),),
            rationale=(
                f"{_where(diagnosis)}. {knob} {before} -> {before // 2}: an explicit cap on "
                "generated tokens bounds the KV cache. Eval outputs get shorter."
            ),
            expected_effect="KV-cache memory in generate roughly halves",
            cost=Cost((0, 0), "changes what evaluation measures (shorter generations)"),
            changes_science=True,
        )
