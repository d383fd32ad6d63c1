"""The one protocol every lever implements, and the records a proposal is made of.

A remediator looks at a diagnosis and the template as it stood when the job died, says whether
it applies (and why not, in words), and proposes a typed patch with its rationale, expected
effect, cost and whether it changes the science. It never decides whether to run: the planner
orders the levers per failure kind and the policy approves.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from daemon.diagnosis import Diagnosis
from daemon.dialects.base import Knobs, KnobValue, Role
from daemon.templates.model import LaunchTemplate
from daemon.templates.revisions import KnobChange, Patch

GIB = 1024**3
MIB = 1024**2


class Lever(StrEnum):
    """What a remediator moves; the planner's hard rules are written in levers."""

    ALLOCATOR = "allocator"
    BATCH = "batch"
    RECOMPUTE = "recompute"
    SHARDING = "sharding"
    OPTIMIZER = "optimizer"
    EVAL = "eval"
    WORKERS = "workers"
    SEQUENCE = "sequence"
    PLACEMENT = "placement"


class NotApplicable(Exception):
    """`propose` was called on a diagnosis/template the remediator does not apply to."""


@dataclass(frozen=True)
class Applicability:
    applies: bool
    reason: str

    def __bool__(self) -> bool:
        return self.applies


def yes(reason: str) -> Applicability:
    return Applicability(True, reason)


def no(reason: str) -> Applicability:
    return Applicability(False, reason)


@dataclass(frozen=True)
class Cost:
    """Expected throughput loss as a percentage range, and what else it costs."""

    throughput_loss_pct: tuple[int, int]
    note: str

    def describe(self) -> str:
        low, high = self.throughput_loss_pct
        span = f"{low}%" if low == high else f"{low}-{high}%"
        return f"~{span} throughput; {self.note}"


class NodeActionKind(StrEnum):
    DRAIN = "drain"


@dataclass(frozen=True)
class NodeAction:
    """Something the daemon does to a node besides patching the template (a drain)."""

    kind: NodeActionKind
    node: str
    reason: str  # starts with MEDIC_REASON_PREFIX


@dataclass(frozen=True)
class RemediationProposal:
    """One lever's concrete proposal: the patch, and the words a person needs to approve it."""

    remediator: str
    lever: Lever
    changes: tuple[KnobChange, ...]
    rationale: str
    expected_effect: str
    cost: Cost
    changes_science: bool
    actions: tuple[NodeAction, ...] = ()

    @property
    def patch(self) -> Patch:
        """The typed patch of the template, carrying the rationale as its reason."""
        return Patch(self.changes, f"{self.remediator}: {self.rationale}")


class Remediator(Protocol):
    """A lever: `applies` explains itself, `propose` raises NotApplicable where it does not."""

    @property
    def name(self) -> str: ...

    @property
    def lever(self) -> Lever: ...

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability: ...

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal: ...


def role_knob(template: LaunchTemplate, role: Role) -> str | None:
    return template.dialect.knob_for(role)


def is_unset(template: LaunchTemplate, knob: str) -> bool:
    """True when the script never set this knob, so its real value is the program's default."""
    return not template.dialect.spec(knob).is_set(template.knobs[knob])


def explicit_knob(template: LaunchTemplate, role: Role, what: str) -> str | Applicability:
    """The knob that plays `role`, or why a lever moving it does not apply: the dialect has no
    `what` knob, the template does not manage it (an imported script that does not write it),
    or the script never set it (its value is then the program's default)."""
    knob = template.dialect.knob_for(role)
    if knob is None:
        return no(f"dialect {template.dialect.name} has no {what} knob")
    refused = not_managed(template, knob)
    if refused is not None:
        return refused
    if is_unset(template, knob):
        return no(f"{knob} is not set in the template: its value is the program's default")
    return knob


def not_managed(template: LaunchTemplate, *knobs: str | None) -> Applicability | None:
    """Why a lever that reads or moves these knobs does not apply: the first of them the
    template does not manage, in words; None when it manages them all (a lever never invents
    the value of a setting the script does not write)."""
    for knob in knobs:
        if knob is not None and knob in template.not_managed:
            return no(f"{knob} is not managed in this template: {template.not_managed[knob]}")
    return None


def int_knob(knobs: Knobs, name: str) -> int:
    value = knobs[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is not an integer knob")
    return value


def change(knobs: Knobs, name: str, after: KnobValue) -> KnobChange:
    return KnobChange(name, knobs[name], after)


def human_bytes(count: int | None) -> str:
    if count is None:
        return "unknown"
    if count >= GIB:
        return f"{count / GIB:.2f} GiB"
    return f"{count / MIB:.1f} MiB"


def require(applicability: Applicability) -> None:
    if not applicability:
        raise NotApplicable(applicability.reason)
