"""Host RAM: fewer dataloader workers. Each worker is a process with its own copy of the
dataset state; the model, the batch and the science are untouched."""

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


@dataclass(frozen=True)
class WorkersDown:
    name: str = "dataloader_workers_down"
    lever: Lever = Lever.WORKERS

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        knob = explicit_knob(template, Role.WORKERS, "dataloader workers")
        if isinstance(knob, Applicability):
            return knob
        if int_knob(template.knobs, knob) == 0:
            return no(f"{knob} is already 0")
        return yes("each dataloader worker holds its own host memory")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        knob = template.dialect.roles[Role.WORKERS]
        before = int_knob(template.knobs, knob)
        after = before // 2
        gpus_knob = template.dialect.roles[Role.GPUS_PER_NODE]
        if gpus_knob in template.not_managed:  # ranks per node unknown: say it per rank
            fewer = f"{before - after} fewer worker processes per rank"
        else:
            ranks = int_knob(template.knobs, gpus_knob)
            fewer = f"{ranks * (before - after)} fewer worker processes per node"
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(change(template.knobs, knob, after),),
            rationale=(
                "Host RAM: the job was killed by the host OOM killer on "
                f"{diagnosis.node or 'its node'} with no GPU traceback. "
                f"{knob} {before} -> {after} per rank: {fewer}."
            ),
            expected_effect="host memory per node falls; GPU memory is untouched",
            cost=Cost((0, 20), "only if the job is input-bound"),
            changes_science=False,
        )
