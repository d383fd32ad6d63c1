"""What every diagnosis rule reads: the evidence with its figures held to their ranges, the
lineage's history, and the log's root cause; and the one way a rule writes its verdict.

Apart from the rules so that `dispatch`, `hardware` and `device_oom` share it and no rule
imports the dispatcher: each verdict carries the same location and the reasons set aside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, History
from daemon.evidence.records import Evidence, LogFindings, RootCause


@dataclass(frozen=True)
class RuleContext:
    """One job's evidence as every rule reads it."""

    evidence: Evidence
    history: History
    set_aside: tuple[str, ...] = ()  # figures out of range, said in every verdict
    root_cause: RootCause | None = None  # the log's, see `_root_cause`

    @property
    def log(self) -> LogFindings:
        return self.evidence.log

    @property
    def node(self) -> str | None:
        if self.log.node is not None:
            return self.log.node
        job = self.evidence.job
        if job is not None and len(job.nodes) == 1:
            return job.nodes[0]
        return None

    def verdict(
        self,
        kind: FailureKind,
        confidence: Confidence,
        reasons: list[str],
        **extra: Any,
    ) -> Diagnosis:
        log = self.log
        return Diagnosis(
            kind=kind,
            confidence=confidence,
            reasons=(*reasons, *self.set_aside),
            rank=log.rank,
            node=self.node,
            step=log.step,
            phase=log.phase,
            oom=log.oom,
            root_cause=self.root_cause,
            root_cause_line=self.root_cause_line,
            **extra,
        )

    @property
    def root_cause_line(self) -> str | None:
        """The line that shows the log's root cause, as the scanner kept it."""
        if self.root_cause is None:
            return None
        log = self.log
        if self.root_cause is RootCause.GPU_FAULT and log.gpu_fault is not None:
            return log.gpu_fault.line
        if log.root_failure_line is not None:
            return log.root_failure_line
        return None if log.oom is None else log.oom.message


def quote(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return f'"{text[: limit - 3]}..."' if len(text) > limit else f'"{text}"'
