"""The device-OOM rules: what an out-of-memory message on the accelerator says, weighed on its
figures (the runbooks' fragmentation rule, a request beyond any device, Apple's watermark,
the card's capacity), then by where and when it ran out.

Apart from `dispatch` because they are the diagnosis's longest and the thresholds below are
theirs alone; co-tenants an OOM message lists are `hardware`'s rule.
"""

from __future__ import annotations

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, MidRunCause, Onset
from daemon.evidence.records import OomFamily, OomReport, Phase, RootCause
from daemon.evidence.units import GIB, format_size, rounding_error
from daemon.rules.context import RuleContext, quote
from daemon.rules.hardware import holder_words, listed_cotenants, message_cotenant

# Thresholds. Each says why it has the value it has.
# The fragmentation rule (the runbooks', and the allocator's own hint) has no thresholds: with X
# the request, F the driver-free and U the reserved-but-unallocated bytes, F + U >= X means the
# bytes existed. Its margin F + U - X only sets the confidence: within the printed figures'
# rounding it may be rounding alone (low); below the request again it is thin (medium).
# Beyond any device: twice the largest accelerator memory sold today (288 GB, B300 / MI355X).
# One allocation lives on one device, so a request beyond this is a size bug in the program
# (an overflowed or mis-multiplied shape), not memory pressure (tests/data/real/oom/146:
# 573.65 GiB asked of a 40 GB card).
BEYOND_ANY_DEVICE_BYTES = 512 * GIB
# A single request of this share of the card inside attention/matmul/conv/MoE frames is a
# workspace spike rather than the model's steady state.
WORKSPACE_SPIKE_SHARE = 0.10
WORKSPACE_SPIKE_MIN_BYTES = 1024 * 1024 * 1024  # when the card's capacity is unknown
# Adam-style optimizers allocate their state at the first optimizer.step: an OOM at step 1-2
# is that state arriving, not data or growth.
OPTIMIZER_STATE_MAX_STEP = 2
# A failed request this small, on a full card, late in the run: memory crept up (growth); a
# large one is a batch bigger than any before (longest batch).
GROWTH_MAX_REQUEST_SHARE = 0.02
# Memory neither free nor in PyTorch's cache beyond this share of the card is worth naming.
OUTSIDE_CACHE_SHARE = 0.25


def gpu_oom(context: RuleContext) -> Diagnosis | None:
    """The device's memory, when the log's root failure is a device OOM message."""
    oom = context.log.oom
    if oom is None or oom.family is OomFamily.HOST_RAM:
        line = context.root_cause_line
        if context.root_cause is RootCause.ACCELERATOR_OOM and line:
            reasons = [
                f"the log's first failure is out of device memory: {quote(line)}",
                "but no figures were read from it: nothing to weigh",
            ]
            return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
        return None
    reasons = [f"{_family_words(oom)}: {quote(oom.message)}"]
    if oom.family in _SIZING_WORDS:
        # no allocator figures: nothing the training loop's batch levers can be weighed on
        reasons.extend(_SIZING_WORDS[oom.family])
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if oom.family is OomFamily.TORCH_ALLOCATOR:
        verdict = _fragmentation_rule(context, oom, reasons)
        if verdict is not None:
            return verdict
    elif oom.request_beyond_any_device:
        return _size_bug(context, oom, reasons)
    verdict = message_cotenant(context, oom, reasons)
    if verdict is not None:
        return verdict
    reasons.extend(_capacity_reasons(oom))
    phase = context.log.phase
    if phase is Phase.OPTIMIZER_STEP:
        reasons.append("it ran out inside optimizer.step: optimizer state or its update burst")
        return context.verdict(FailureKind.OPTIMIZER_BURST, _numbers_confidence(oom), reasons)
    if phase in (Phase.EVAL, Phase.GENERATE):
        reasons.append("it ran out in evaluation or generation: eval batch or KV cache growth")
        return context.verdict(FailureKind.EVAL_GROWTH, _numbers_confidence(oom), reasons)
    spike = _workspace_spike(context, oom)
    if spike is not None:
        reasons.append(spike)
        return context.verdict(FailureKind.WORKSPACE_SPIKE, _numbers_confidence(oom), reasons)
    return _true_oom(context, oom, reasons)


# Out-of-memory families that print no allocator figures and whose cause is not the training
# loop's memory: what they mean and where to look, since nothing is proposed for them.
_SIZING_WORDS: dict[OomFamily, tuple[str, ...]] = {
    OomFamily.KV_CACHE: (
        "the engine sizes its KV cache from the GPU memory left after the model's weights, and"
        " none (or too little for one request) was left: its memory share, max model length,"
        " the model's size or another process on the GPU decides it, not a training batch",
        "raise the engine's share (vLLM `gpu_memory_utilization`, SGLang"
        " `--mem-fraction-static`) or lower its `max_model_len`; nothing is proposed",
    ),
    OomFamily.LIBRARY_HANDLE: (
        "cublasCreate and cudnnCreate allocate on the device, so a failed handle is most often a"
        " device out of memory; a CUDA or cuDNN build that does not fit the card reads the same:"
        " weak evidence, with no figures to weigh",
        "check the card's memory at that point (another process, the run's own peak) and the"
        " CUDA/cuDNN install; nothing is proposed",
    ),
}


def _fragmentation_rule(
    context: RuleContext, oom: OomReport, reasons: list[str]
) -> Diagnosis | None:
    """The runbooks' rule on PyTorch's figures; None where it says true OOM (the caller goes on).

    With X the request, F the driver-free and U the reserved-but-unallocated bytes: X beyond
    any device is a size bug; X larger than the card a single tensor the device cannot hold;
    F >= X leaves nothing to explain it; U >= X or F + U >= X is fragmentation (unless the run
    already had expandable segments); a figure missing leaves the rule undecided.
    """
    requested, total = oom.requested_bytes, oom.total_bytes
    free, unallocated = oom.free_bytes, oom.reserved_unallocated_bytes
    if oom.request_beyond_any_device or (
        requested is not None and requested > BEYOND_ANY_DEVICE_BYTES
    ):
        return _size_bug(context, oom, reasons)
    if oom.other_allocations_bytes is not None:
        return _mps_watermark(context, oom, reasons)
    if not requested:
        reasons.append(
            "the message gives no request (or 0 bytes) to weigh the other figures against:"
            " the rule cannot tell fragmentation from a full card"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if total is not None and requested > total:
        reasons.append(
            f"the {format_size(requested)} request alone is larger than the whole"
            f" {format_size(total)} card: a single tensor bigger than the device; batch levers"
            " at the same geometry may not help (split, shard or shorten what makes it)"
        )
        return _true_oom(context, oom, reasons)
    if free is not None and free >= requested:
        more = "more than" if free > requested else "as much as"
        reasons.append(
            f"the driver still had {format_size(free)} free, {more} the"
            f" {format_size(requested)} asked for: neither capacity nor fragmentation explains it"
        )
        if oom.allowed_bytes is not None:
            reasons.append(
                f"the message prints {format_size(oom.allowed_bytes)} allowed: a per-process"
                " memory fraction cap (torch.cuda.set_per_process_memory_fraction) refused it"
                " below the card's capacity"
            )
        else:
            reasons.append(
                "look for a per-process memory fraction cap, a MIG slice smaller than the card,"
                " or another process that raced for the memory"
            )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if unallocated is not None and (unallocated + (free or 0)) >= requested:
        return _fragmentation(context, oom, requested, unallocated, reasons)
    if free is None or unallocated is None:
        missing = "driver-free" if free is None else "reserved-but-unallocated"
        reasons.append(
            f"the message prints no {missing} figure: the rule cannot tell fragmentation"
            " from a full card"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    reasons.append(
        f"{format_size(free)} free and {format_size(unallocated)} reserved but unallocated"
        f" fall {format_size(requested - free - unallocated)} short of the"
        f" {format_size(requested)} request: not fragmentation"
    )
    return None


def _fragmentation(
    context: RuleContext, oom: OomReport, requested: int, unallocated: int, reasons: list[str]
) -> Diagnosis | None:
    free = oom.free_bytes or 0
    margin = free + unallocated - requested
    if unallocated >= requested:
        held = f"{format_size(unallocated)} reserved but unallocated alone covers"
    else:
        held = (
            f"{format_size(free)} free and {format_size(unallocated)} reserved but unallocated"
            f" ({format_size(free + unallocated)}) cover"
        )
    share = f", {margin / oom.total_bytes:.1%} of the card" if oom.total_bytes else ""
    reasons.append(
        f"{held} the {format_size(requested)} request with {format_size(margin)} to spare"
        f"{share}: the bytes existed but not in one piece"
    )
    if context.evidence.expandable_segments:
        reasons.append(
            "the run already had expandable_segments:True, which lets a segment grow in place:"
            " stranded bytes are not the story, the card was full; taken as a true OOM"
        )
        return None
    reasons.extend(holder_words(process) for process in listed_cotenants(context))
    slack = rounding_error(requested) + rounding_error(free) + rounding_error(unallocated)
    if margin <= slack:
        confidence = Confidence.LOW
        reasons.append("the margin is within the rounding of the printed figures")
    elif margin < requested:
        confidence = Confidence.MEDIUM
        reasons.append("a thin margin: less than the request again")
    else:
        confidence = Confidence.HIGH
    reasons.append("fragmentation: set expandable_segments:True before any batch change")
    return context.verdict(FailureKind.FRAGMENTATION, confidence, reasons)


def _size_bug(context: RuleContext, oom: OomReport, reasons: list[str]) -> Diagnosis:
    requested, total = oom.requested_bytes, oom.total_bytes
    if requested is None:
        asked = "a request beyond 1 EiB"
    else:
        asked = f"the {format_size(requested)} request"
        if total:
            asked += f" alone is larger than the whole {format_size(total)} card and"
    reasons.append(
        f"{asked} beyond any device: a size bug in the program (an overflowed or mis-multiplied"
        " shape), not memory pressure"
    )
    return context.verdict(FailureKind.NOT_OOM, Confidence.HIGH, reasons)


def _mps_watermark(context: RuleContext, oom: OomReport, reasons: list[str]) -> Diagnosis | None:
    """Apple's allocator refuses past its high watermark (`max allowed`)."""
    requested, allocated = oom.requested_bytes, oom.allocated_bytes
    other, allowed = oom.other_allocations_bytes or 0, oom.allowed_bytes
    if other > BEYOND_ANY_DEVICE_BYTES:
        reasons.append(
            f"MPS counts {format_size(other)} of other allocations, beyond any machine: its"
            " accounting is broken, not the memory"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if requested is None or allocated is None or allowed is None:
        reasons.append("the MPS message lacks a figure: nothing to weigh")
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    wanted = allocated + other + requested
    if wanted <= allowed:
        reasons.append(
            f"MPS allocated {format_size(allocated)} and other allocations"
            f" {format_size(other)} with the {format_size(requested)} request stay under its"
            f" {format_size(allowed)} max allowed: the device itself could not serve it"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    reasons.append(
        f"MPS allocated {format_size(allocated)} + other allocations {format_size(other)} +"
        f" the {format_size(requested)} request = {format_size(wanted)}, over its"
        f" {format_size(allowed)} max allowed (the high watermark)"
    )
    return None


def _capacity_reasons(oom: OomReport) -> list[str]:
    reasons: list[str] = []
    if oom.total_bytes and oom.free_bytes is not None and oom.reserved_bytes is not None:
        elsewhere = oom.total_bytes - oom.free_bytes - oom.reserved_bytes
        if elsewhere >= oom.total_bytes * OUTSIDE_CACHE_SHARE:
            reasons.append(
                f"{format_size(elsewhere)} of the card was neither free nor in PyTorch's cache:"
                " another process or non-PyTorch memory held it"
            )
    if oom.private_pool_bytes:
        reasons.append(
            f"{format_size(oom.private_pool_bytes)} of it sat in private pools (CUDA graphs)"
        )
    if oom.total_bytes and oom.allocated_bytes is not None:
        reasons.append(
            f"PyTorch held {format_size(oom.allocated_bytes)} of the"
            f" {format_size(oom.total_bytes)} card ({oom.allocated_bytes / oom.total_bytes:.0%})"
        )
    return reasons


def _numbers_confidence(oom: OomReport) -> Confidence:
    if not oom.requested_bytes:  # none printed, or 0 bytes: no size to weigh the others against
        return Confidence.LOW
    return Confidence.HIGH if oom.reserved_unallocated_bytes is not None else Confidence.MEDIUM


def _workspace_spike(context: RuleContext, oom: OomReport) -> str | None:
    kernels = context.log.heavy_kernels
    if oom.family in (OomFamily.CUBLAS, OomFamily.CUDNN) and not kernels:
        kernels = ("cublas_matmul",) if oom.family is OomFamily.CUBLAS else ("cudnn_conv",)
    if not kernels:
        return None
    requested = oom.requested_bytes
    if requested is None:
        if oom.family in (OomFamily.CUBLAS, OomFamily.CUDNN):
            return f"{oom.family.value} could not allocate its workspace"
        return None
    threshold = (
        oom.total_bytes * WORKSPACE_SPIKE_SHARE if oom.total_bytes else WORKSPACE_SPIKE_MIN_BYTES
    )
    if requested < threshold:
        return None
    where = ", ".join(kernels)
    share = f" ({requested / oom.total_bytes:.0%} of the card)" if oom.total_bytes else ""
    return (
        f"a single {format_size(requested)} request{share} inside {where} frames: workspace spike"
    )


def _true_oom(context: RuleContext, oom: OomReport, reasons: list[str]) -> Diagnosis:
    step = context.log.step
    confidence = _numbers_confidence(oom)
    if step is None or step <= 0:
        if step is None:
            reasons.append(
                "no training step was logged before it: taken as the first step, where the"
                " static sizing does not fit"
            )
        else:
            reasons.append("it failed at the first step: the static sizing does not fit")
        return context.verdict(FailureKind.TRUE_OOM, confidence, reasons, onset=Onset.STEP0)
    cause = _mid_run_cause(oom, step)
    reasons.append(_CAUSE_WORDS[cause].format(step=step))
    earlier = [d for d in context.history.earlier if d.is_oom and d.step is not None]
    if earlier:
        previous = earlier[-1]
        reasons.append(
            f"this lineage failed before at step {previous.step} ({previous.kind.value})"
        )
    return context.verdict(
        FailureKind.TRUE_OOM, confidence, reasons, onset=Onset.MID_RUN, mid_run_cause=cause
    )


_CAUSE_WORDS = {
    MidRunCause.OPTIMIZER_STATE: (
        "it failed at step {step}, right after the first optimizer step allocated its state"
    ),
    MidRunCause.GROWTH: (
        "it failed at step {step} on a small request with the card full: memory grew over the run"
    ),
    MidRunCause.LONGEST_BATCH: (
        "it failed at step {step} on a large request: a batch longer than any before it"
    ),
}


def _mid_run_cause(oom: OomReport, step: int) -> MidRunCause:
    if step <= OPTIMIZER_STATE_MAX_STEP:
        return MidRunCause.OPTIMIZER_STATE
    small_request = (
        oom.requested_bytes is not None
        and bool(oom.total_bytes)
        and oom.requested_bytes <= (oom.total_bytes or 0) * GROWTH_MAX_REQUEST_SHARE
    )
    return MidRunCause.GROWTH if small_request else MidRunCause.LONGEST_BATCH


def _family_words(oom: OomReport) -> str:
    return {
        OomFamily.TORCH_ALLOCATOR: "PyTorch's allocator ran out of GPU memory",
        OomFamily.CUDA_RUNTIME: "the CUDA runtime ran out of GPU memory",
        OomFamily.CUBLAS: "cuBLAS could not allocate GPU memory",
        OomFamily.CUDNN: "cuDNN could not allocate GPU memory",
        OomFamily.NCCL: "NCCL could not allocate GPU memory",
        OomFamily.XLA: "XLA ran out of device memory",
        OomFamily.ONNX_RUNTIME: "ONNX Runtime's arena could not allocate device memory",
        OomFamily.KV_CACHE: "the inference engine found no GPU memory left for its KV cache",
        OomFamily.LIBRARY_HANDLE: (
            f"{'cuBLAS' if 'CUBLAS' in oom.message else 'cuDNN'} could not create its handle"
        ),
        OomFamily.HOST_RAM: "the host ran out of RAM",
    }[oom.family]
