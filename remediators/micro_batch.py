"""Micro-batch down, gradient accumulation up: the global batch (and the science) stay the same.

"Halved" in the common case; an odd micro-batch is divided by its smallest prime factor, so
the invariant global = micro x accum x data-parallel always holds exactly. Megatron derives the
accumulation from its fixed global batch, so only the micro-batch knob moves there.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.diagnosis import Diagnosis, MidRunCause, Onset
from daemon.dialects.base import KnobError, Role
from daemon.imported import invariant_terms
from daemon.templates.model import LaunchTemplate, invariant_known
from daemon.templates.revisions import KnobChange
from remediators.base import (
    Applicability,
    Cost,
    Lever,
    NotApplicable,
    RemediationProposal,
    change,
    human_bytes,
    int_knob,
    no,
    not_managed,
    require,
    yes,
)


def smallest_factor(number: int) -> int:
    factor = 2
    while factor * factor <= number:
        if number % factor == 0:
            return factor
        factor += 1
    return number


def why_it_ran_out(diagnosis: Diagnosis) -> str:
    """The runbook's wording for a true OOM: static sizing at step 0, or which mid-run cause."""
    oom = diagnosis.oom
    numbers = ""
    if oom is not None:
        numbers = (
            f" ({human_bytes(oom.requested_bytes)} requested, "
            f"{human_bytes(oom.reserved_bytes)} reserved of {human_bytes(oom.total_bytes)})"
        )
    if diagnosis.onset is Onset.MID_RUN:
        cause = {
            MidRunCause.LONGEST_BATCH: "the longest batch so far",
            MidRunCause.GROWTH: "memory that grew over the run",
            MidRunCause.OPTIMIZER_STATE: "optimizer state allocated after the first steps",
            None: "an unidentified mid-run cause",
        }[diagnosis.mid_run_cause]
        return f"ran out mid-run at step {diagnosis.step}, driven by {cause}{numbers}"
    return f"ran out at the first step: the static sizing does not fit{numbers}"


def _fixed_global_summary(template: LaunchTemplate, micro: int, factor: int) -> str:
    """The plan in words where the data-parallel size is not known (an imported Megatron
    script: its tensor and pipeline sizes are not managed). The global batch is a knob of its
    own that does not move, and it was a multiple of micro x data-parallel, so it still is of
    the smaller micro-batch: the framework derives an accumulation `factor` times larger."""
    dialect = template.dialect
    unknown = [t for t in invariant_terms(dialect) if t in template.not_managed]
    global_batch = template.knobs[dialect.roles[Role.GLOBAL_BATCH]]
    return (
        f"micro-batch {micro} -> {micro // factor}; the global batch stays {global_batch} and "
        f"the accumulation it implies grows {factor}x ({', '.join(unknown)} not managed here, "
        "so the data-parallel size is not known)"
    )


@dataclass(frozen=True)
class MicroBatchDown:
    name: str = "micro_batch_down"
    lever: Lever = Lever.BATCH

    def _plan(self, template: LaunchTemplate) -> tuple[tuple[KnobChange, ...], str] | str:
        dialect, knobs = template.dialect, template.knobs
        micro_knob = dialect.roles[Role.MICRO_BATCH]
        accum_knob = dialect.knob_for(Role.GRAD_ACCUM)
        # The micro-batch, what keeps the global batch, and the world it is spread over; a
        # fixed global batch keeps itself whatever the model-parallel sizes are.
        needed = invariant_terms(dialect)
        if dialect.global_batch_fixed:
            needed = (micro_knob, dialect.roles[Role.GLOBAL_BATCH])
            needed += (dialect.roles[Role.NODES], dialect.roles[Role.GPUS_PER_NODE])
        refused = not_managed(template, *needed)
        if refused is not None:
            return refused.reason
        micro = int_knob(knobs, micro_knob)
        if micro <= 1:
            return "the micro-batch is already 1"
        factor = smallest_factor(micro)
        changes = [change(knobs, micro_knob, micro // factor)]
        if not invariant_known(dialect, template.not_managed):
            return tuple(changes), _fixed_global_summary(template, micro, factor)
        before = dialect.geometry(knobs)
        if not dialect.global_batch_fixed and accum_knob is not None:
            accum = int_knob(knobs, accum_knob)
            maximum = dialect.spec(accum_knob).maximum
            if maximum is not None and accum * factor > maximum:
                return f"{accum_knob} x{factor} would pass its maximum {maximum}"
            changes.append(change(knobs, accum_knob, accum * factor))
        after_knobs = dict(knobs)
        for item in changes:
            after_knobs[item.knob] = item.after
        try:
            after = dialect.geometry(after_knobs)
        except KnobError as error:
            return f"the invariant cannot hold: {error}"
        if after.global_batch != before.global_batch:
            return f"the global batch would move {before.global_batch} -> {after.global_batch}"
        summary = (
            f"micro-batch {before.micro} -> {after.micro}, accumulation {before.accum} -> "
            f"{after.accum}; global batch stays {after.global_batch} = {after.micro} x "
            f"{after.accum} x {after.data_parallel} data-parallel"
        )
        return tuple(changes), summary

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        planned = self._plan(template)
        return no(planned) if isinstance(planned, str) else yes(planned[1])

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        planned = self._plan(template)
        if isinstance(planned, str):
            raise NotApplicable(planned)
        changes, summary = planned
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=changes,
            rationale=f"True OOM: the job {why_it_ran_out(diagnosis)}. {summary}.",
            expected_effect="activation memory per micro-batch roughly halves; same optimizer step",
            cost=Cost((5, 15), "smaller kernels and more accumulation steps per optimizer step"),
            changes_science=False,
        )
