"""Placement: keep the run off a bad node. Hardware faults that the node probe confirmed also
drain the node (an action the daemon performs, with a `medic:` reason); a fault seen only in
the job's log, and a co-tenant's node, are only excluded (the pid reported), because the log is
the job's own text and the co-tenant's node is healthy."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.diagnosis import Diagnosis, FailureKind
from daemon.dialects.base import Role
from daemon.slurm.records import MEDIC_REASON_PREFIX
from daemon.templates.model import LaunchTemplate
from daemon.templates.revisions import KnobChange
from remediators.base import (
    Applicability,
    Cost,
    Lever,
    NodeAction,
    NodeActionKind,
    RemediationProposal,
    change,
    no,
    not_managed,
    require,
    yes,
)

_MAX_REASON = 200


def _new_nodes(diagnosis: Diagnosis, template: LaunchTemplate) -> tuple[str, ...]:
    knob = template.dialect.roles[Role.EXCLUDE]
    excluded = template.knobs[knob]
    already = set(excluded) if isinstance(excluded, tuple) else set()
    return tuple(node for node in dict.fromkeys(diagnosis.bad_nodes) if node not in already)


def _exclude(template: LaunchTemplate, nodes: tuple[str, ...]) -> KnobChange:
    """The change that appends `nodes` to the template's exclude list."""
    knob = template.dialect.roles[Role.EXCLUDE]
    excluded = template.knobs[knob]
    before = tuple(str(node) for node in excluded) if isinstance(excluded, tuple) else ()
    return change(template.knobs, knob, tuple(dict.fromkeys(before + nodes)))


def _clean(text: str) -> str:
    return "".join(char if char.isprintable() else " " for char in text)[:_MAX_REASON]


@dataclass(frozen=True)
class ExcludeNode:
    name: str = "exclude_node"
    lever: Lever = Lever.PLACEMENT

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        if not diagnosis.bad_nodes:
            return no("the diagnosis names no bad node")
        if (refused := not_managed(template, template.dialect.roles[Role.EXCLUDE])) is not None:
            return refused
        if not _new_nodes(diagnosis, template):
            return no(f"{', '.join(diagnosis.bad_nodes)} already excluded")
        return yes(f"{', '.join(diagnosis.bad_nodes)} should not run this job")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        nodes = _new_nodes(diagnosis, template)
        pids = ", ".join(str(pid) for pid in diagnosis.cotenant_pids) or "unknown"
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(_exclude(template, nodes),),
            rationale=(
                f"Co-tenant: another process (pid {pids}) held GPU memory on "
                f"{', '.join(nodes)}. The batch is not the problem and is not cut; the "
                "relaunch avoids the node."
            ),
            expected_effect="the same config runs on GPUs it has to itself",
            cost=Cost((0, 0), "a smaller pool of nodes; possibly a longer queue wait"),
            changes_science=False,
        )


@dataclass(frozen=True)
class DrainAndExclude:
    name: str = "drain_and_exclude"
    lever: Lever = Lever.PLACEMENT

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        if diagnosis.kind is not FailureKind.HARDWARE:
            return no("only a hardware diagnosis drains a node")
        if not diagnosis.probe_confirmed:
            return no("no node probe confirmed the fault: a job's log alone drains nothing")
        return ExcludeNode().applies(diagnosis, template)

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        nodes = _new_nodes(diagnosis, template)
        evidence = _clean("; ".join(diagnosis.reasons) or "GPU hardware fault")
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(_exclude(template, nodes),),
            rationale=(
                f"Hardware: {evidence}. The node is drained so no other job lands on it, and the "
                "relaunch excludes it."
            ),
            expected_effect="the same config runs on healthy GPUs",
            cost=Cost((0, 0), f"{len(nodes)} node(s) out of service until an admin resumes them"),
            changes_science=False,
            actions=tuple(
                NodeAction(
                    NodeActionKind.DRAIN, node, f"{MEDIC_REASON_PREFIX} {evidence}"[:_MAX_REASON]
                )
                for node in nodes
            ),
        )
