"""Sequence length down. This changes what the model learns from, so it is only ever offered
to a person, never applied on its own; length bucketing is named as the alternative."""

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
    int_knob,
    no,
    require,
    yes,
)

_MIN_SEQUENCE = 128


@dataclass(frozen=True)
class SequenceLengthDown:
    name: str = "sequence_length_down"
    lever: Lever = Lever.SEQUENCE

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = explicit_knob(template, Role.SEQ_LENGTH, "sequence length")
        if isinstance(knob, Applicability):
            return knob
        if int_knob(template.knobs, knob) < 2 * _MIN_SEQUENCE:
            return no(f"{knob} is already short ({template.knobs[knob]})")
        return yes("activation and attention memory grow with sequence length")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.SEQ_LENGTH]
        before = int_knob(template.knobs, knob)
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, before // 2),),
            rationale=(
                f"Sequence pressure ({diagnosis.kind.value}): {knob} {before} -> {before // 2}. "
                "This changes the training data the model sees; length bucketing or packing "
                "shorter batches is the alternative a person may prefer."
            ),
            expected_effect="activation memory roughly halves (attention more)",
            cost=Cost((0, 0), "changes the science: different context length"),
            changes_science=True,
        )
