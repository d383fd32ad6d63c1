"""The diagnosis: evidence in, a verdict out, with the numbers and rules that decided it.

Pure: imports no subprocess, SSH or SQL. `diagnose` is implemented below the types.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from daemon.evidence.records import OomReport, Phase


class FailureKind(StrEnum):
    """What killed the job; each kind has its own remediation ladder."""

    HARDWARE = "hardware"
    COTENANT = "cotenant"
    HOST_RAM = "host_ram"
    FRAGMENTATION = "fragmentation"
    TRUE_OOM = "true_oom"
    WORKSPACE_SPIKE = "workspace_spike"
    OPTIMIZER_BURST = "optimizer_burst"
    EVAL_GROWTH = "eval_growth"
    NOT_OOM = "not_oom"
    UNKNOWN = "unknown"


class Onset(StrEnum):
    """Step 0 means static sizing is wrong; mid-run means something grew or a batch was longer."""

    STEP0 = "step0"
    MID_RUN = "mid_run"


class MidRunCause(StrEnum):
    """Why a run that had been stepping ran out later."""

    LONGEST_BATCH = "longest_batch"
    GROWTH = "growth"
    OPTIMIZER_STATE = "optimizer_state"


class Confidence(StrEnum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


@dataclass(frozen=True)
class Diagnosis:
    """The verdict on one failure: kind, where and when, and reasons a person can check."""

    kind: FailureKind
    confidence: Confidence
    reasons: tuple[str, ...]
    onset: Onset | None = None
    mid_run_cause: MidRunCause | None = None
    rank: int | None = None
    node: str | None = None
    step: int | None = None
    phase: Phase = Phase.UNKNOWN
    oom: OomReport | None = None
    bad_nodes: tuple[str, ...] = ()  # nodes to exclude (hardware, co-tenant)
    cotenant_pids: tuple[int, ...] = ()

    @property
    def is_oom(self) -> bool:
        return self.kind not in (FailureKind.NOT_OOM, FailureKind.UNKNOWN)


@dataclass(frozen=True)
class History:
    """Earlier diagnoses of the same lineage, oldest first: tells repeat failures and growth."""

    earlier: tuple[Diagnosis, ...] = ()
