"""The diagnosis's records: the verdict (what killed the job, how sure, the reasons) and the
lineage's earlier verdicts it is weighed with.

Apart from the rules that decide it (`daemon.rules`) because the planner, the levers, the store
and the CLI read a verdict without deciding one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from daemon.evidence.records import (
    OomReport,
    Phase,
    RootCause,
)


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
    # The node probe itself showed the fault (XID, remap, ECC). Only then is a node drained: a
    # job's log is the job's own text, and anyone can print an Xid line.
    probe_confirmed: bool = False
    cotenant_pids: tuple[int, ...] = ()
    root_cause: RootCause | None = None  # the log's earliest root failure; None: none shown
    root_cause_line: str | None = None  # the log line that shows it

    @property
    def is_oom(self) -> bool:
        return self.kind not in (FailureKind.NOT_OOM, FailureKind.UNKNOWN)


@dataclass(frozen=True)
class History:
    """Earlier diagnoses of the same lineage, oldest first: tells repeat failures and growth."""

    earlier: tuple[Diagnosis, ...] = ()
