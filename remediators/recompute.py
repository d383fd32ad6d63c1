"""Activation recompute: selective first (attention cores), then full (every layer).

Per the runbooks: full recompute costs ~20-30% throughput, selective much less. Neither
changes the science: the same values are computed twice instead of stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.diagnosis import Diagnosis, FailureKind
from daemon.dialects.base import RECOMPUTE_FULL, RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, KnobKind, Role
from daemon.templates.model import LaunchTemplate
from remediators.base import (
    Applicability,
    Cost,
    Lever,
    RemediationProposal,
    change,
    no,
    not_managed,
    require,
    yes,
)
from remediators.micro_batch import why_it_ran_out


def _why(diagnosis: Diagnosis) -> str:
    if diagnosis.kind is FailureKind.WORKSPACE_SPIKE:
        return "Workspace spike: one large request inside attention/GEMM kernels"
    return f"True OOM: the job {why_it_ran_out(diagnosis)}"


@dataclass(frozen=True)
class SelectiveRecompute:
    name: str = "recompute_selective"
    lever: Lever = Lever.RECOMPUTE

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = template.dialect.knob_for(Role.RECOMPUTE)
        if knob is None:
            return no(f"dialect {template.dialect.name} has no recompute knob")
        if (refused := not_managed(template, knob)) is not None:
            return refused
        spec = template.dialect.spec(knob)
        if spec.kind is not KnobKind.ENUM or RECOMPUTE_SELECTIVE not in spec.choices:
            return no(f"{knob} has no selective mode (only full recompute)")
        if template.knobs[knob] != RECOMPUTE_NONE:
            return no(f"{knob} is already {template.knobs[knob]}")
        return yes("attention activations can be recomputed instead of stored")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.RECOMPUTE]
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, RECOMPUTE_SELECTIVE),),
            rationale=(
                f"{_why(diagnosis)}. Selective recompute drops the attention core's activations "
                "(the quadratic part) and recomputes them in the backward pass."
            ),
            expected_effect="activation memory of attention cores freed; the batch is unchanged",
            cost=Cost((2, 10), "attention recomputed in backward"),
            changes_science=False,
        )


@dataclass(frozen=True)
class FullRecompute:
    name: str = "recompute_full"
    lever: Lever = Lever.RECOMPUTE

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = template.dialect.knob_for(Role.RECOMPUTE)
        if knob is None:
            return no(f"dialect {template.dialect.name} has no recompute knob")
        extras = template.dialect.full_recompute_extras
        if (refused := not_managed(template, knob, *extras)) is not None:
            return refused
        if template.knobs[knob] in (True, RECOMPUTE_FULL):
            return no(f"{knob} is already full")
        return yes("every layer's activations can be recomputed")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        dialect, knobs = template.dialect, template.knobs
        knob = dialect.roles[Role.RECOMPUTE]
        full = True if dialect.spec(knob).kind is KnobKind.BOOL else RECOMPUTE_FULL
        changes = [change(knobs, knob, full)]
        changes += [
            change(knobs, extra, value)
            for extra, value in dialect.full_recompute_extras.items()
            if knobs[extra] != value
        ]
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=tuple(changes),
            rationale=(
                f"{_why(diagnosis)}. Full recompute keeps only each layer's input and recomputes "
                "the rest in the backward pass."
            ),
            expected_effect="activation memory falls to about one tensor per layer",
            cost=Cost((20, 30), "a second forward pass per layer (runbook figure)"),
            changes_science=False,
        )
