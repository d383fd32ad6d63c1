"""The memory model: what one rank of a data-parallel transformer run would hold on its GPU.

Pure functions over frozen records, in bytes, so tests can assert exact figures. The rules
are the runbooks' rules of thumb, not a simulation of any one framework (README.md lists
the formulas):

- 18 bytes per parameter: 2 (bf16 weights) + 4 (fp32 gradients) + 4 (fp32 master weights)
  + 8 (Adam's two moments). ZeRO-1 / Megatron's distributed optimizer shard the last 12
  over the data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 everything; CPU offload
  takes the optimizer's 12 off the card. Adam's moments appear at the first optimizer.step.
- Activations per layer and micro-batch (Korthikanti et al. 2022), with tensor parallel
  degree t: s*b*h*(10 + 24/t) for the linear parts plus 5*a*s*s*b/t for attention;
  selective recompute drops the attention part, full recompute keeps only the layer input
  (2*s*b*h) and recomputes one layer at a time in backward.
- A fragmentation tail of reserved-but-unallocated memory that grows over the first steps
  of a process; `expandable_segments:True` removes it, `max_split_size_mb` and
  `garbage_collection_threshold` shrink it.
- Evaluation holds the KV cache of a batch and the predictions gathered so far on the GPU
  until `eval_accumulation_steps` moves them to the host.

A step is walked allocation by allocation; the first allocation that does not fit in what is
free is the one a real run would have died on, so the OOM message's numbers (request,
allocated, reserved-but-unallocated, free) are the model's own and consistent with each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

GIB = 1 << 30
MIB = 1 << 20

BYTES_WEIGHTS = 2
BYTES_GRADS = 4
BYTES_MASTER = 4
BYTES_ADAM_MOMENTS = 8
BYTES_PER_PARAM = BYTES_WEIGHTS + BYTES_GRADS + BYTES_MASTER + BYTES_ADAM_MOMENTS
# bitsandbytes' 8-bit Adam keeps each moment in one byte and updates in a fused kernel.
BYTES_ADAM_MOMENTS_8BIT = 2
# The multi-tensor Adam update materialises two fp32 lists the size of the moments' shard.
ADAM_UPDATE_TEMP_LISTS = 2
BYTES_ADAM_UPDATE_TEMP = 4

# What CUDA, cuBLAS and NCCL take outside PyTorch's allocator on each rank.
NON_PYTORCH_BYTES = 512 * MIB
# The share of the marketed card the driver keeps: an 80 GiB card reports 79.19 GiB.
USABLE_SHARE = 79.19 / 80
# The fragmentation tail reaches its full size after this many steps of one process.
TAIL_RAMP_STEPS = 3
# Block rounding leaves a little reserved-but-unallocated memory even on the first step
# and with expandable segments.
ROUNDING_SLACK_SHARE = 0.003
# What `max_split_size_mb` at this size or below leaves of the tail, and above it up to
# TAIL_SPLIT_REFERENCE_MB the tail shrinks in proportion.
TAIL_SPLIT_REFERENCE_MB = 2048
TAIL_SPLIT_FLOOR = 0.25
TAIL_GC_THRESHOLD_SHARE = 0.9


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Phase(StrEnum):
    """Where in a step an allocation happens; the traceback's frames follow from it."""

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EVAL = "eval"


class AllocKind(StrEnum):
    """What an allocation is for; the deepest frames of the traceback follow from it."""

    WEIGHTS = "weights"
    LINEAR = "linear"
    ATTENTION = "attention"
    LOGITS = "logits"
    ACTIVATION_GRAD = "activation_grad"
    RECOMPUTE = "recompute"
    ADAM_STATE = "adam_state"
    ADAM_UPDATE = "adam_update"
    KV_CACHE = "kv_cache"
    EVAL_GATHER = "eval_gather"


@dataclass(frozen=True)
class AllocatorConf:
    """The parts of PYTORCH_(CUDA_)ALLOC_CONF that change the fragmentation tail."""

    expandable_segments: bool = False
    max_split_size_mb: int | None = None
    garbage_collection_threshold: float | None = None

    def tail_share(self) -> float:
        """How much of the unconfigured fragmentation tail is left with these settings."""
        if self.expandable_segments:
            return 0.0
        share = 1.0
        if self.max_split_size_mb is not None:
            split_share = self.max_split_size_mb / TAIL_SPLIT_REFERENCE_MB
            share *= max(TAIL_SPLIT_FLOOR, min(1.0, split_share))
        if self.garbage_collection_threshold is not None:
            share *= TAIL_GC_THRESHOLD_SHARE
        return share


def parse_allocator_conf(text: str) -> tuple[AllocatorConf, list[str]]:
    """Parse `key:value,key:value` as PyTorch does; returns the conf and the ignored keys.

    A malformed value of a key that matters is an error (PyTorch refuses to start too);
    keys the model does not use are returned so the caller can say they were ignored.
    """
    expandable = False
    max_split: int | None = None
    gc_threshold: float | None = None
    ignored: list[str] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"allocator option {item!r} is not key:value")
        key, value = key.strip(), value.strip()
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"expandable_segments expects True or False, got {value!r}")
            expandable = value == "True"
        elif key == "max_split_size_mb":
            if not value.isdigit() or int(value) <= 20:
                raise ValueError(f"max_split_size_mb expects an integer above 20, got {value!r}")
            max_split = int(value)
        elif key == "garbage_collection_threshold":
            problem = f"garbage_collection_threshold expects a number in (0, 1), got {value!r}"
            try:
                threshold = float(value)
            except ValueError:
                raise ValueError(problem) from None
            if not 0.0 < threshold < 1.0:
                raise ValueError(problem)
            gc_threshold = threshold
        else:
            ignored.append(key)
    return AllocatorConf(expandable, max_split, gc_threshold), ignored


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder: enough to count parameters and size activations."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_length: int

    @property
    def params(self) -> int:
        """12*L*h^2 for the blocks plus V*h for the (tied) embedding."""
        return 12 * self.num_layers * self.hidden_size**2 + self.vocab_size * self.hidden_size


@dataclass(frozen=True)
class TrainConfig:
    """One rank's view of a run: the knobs the runbook's fixes turn, already resolved."""

    shape: ModelShape
    micro_batch: int
    grad_accum: int
    world_size: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    recompute: Recompute = Recompute.NONE
    recompute_num_layers: int | None = None
    zero_stage: int = 0
    offload_optimizer: bool = False
    optimizer_8bit: bool = False
    allocator: AllocatorConf = field(default_factory=AllocatorConf)
    fragmentation: float = 0.1
    eval_batch: int = 8
    eval_accumulation_steps: int | None = None
    eval_samples: int = 64
    eval_every: int | None = None
    generate_tokens: int = 0
    longest_batch_step: int | None = None
    longest_batch_factor: float = 1.0
    dataloader_workers: int = 2
    max_steps: int = 10

    @property
    def data_parallel(self) -> int:
        return max(1, self.world_size // (self.tensor_parallel * self.pipeline_parallel))

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.data_parallel


@dataclass(frozen=True)
class Card:
    """The GPU a rank runs on, as the node's state makes it."""

    card_gib: float = 80.0
    lost_bytes: int = 0
    cotenant_bytes: int = 0
    cotenant_pid: int | None = None

    @property
    def total_bytes(self) -> int:
        """The capacity PyTorch reports: the usable share, less what a sick card lost."""
        return round(self.card_gib * GIB * USABLE_SHARE) - self.lost_bytes


@dataclass(frozen=True)
class Allocation:
    phase: Phase
    kind: AllocKind
    nbytes: int


@dataclass(frozen=True)
class Release:
    nbytes: int


@dataclass(frozen=True)
class OomEvent:
    """The allocation that failed and the allocator's state at that moment."""

    step: int
    phase: Phase
    kind: AllocKind
    requested: int
    allocated: int
    reserved_unallocated: int
    non_pytorch: int
    cotenant: int
    total: int

    @property
    def process_in_use(self) -> int:
        return self.allocated + self.reserved_unallocated + self.non_pytorch

    @property
    def free(self) -> int:
        return max(0, self.total - self.process_in_use - self.cotenant)


@dataclass(frozen=True)
class StepPeak:
    """The largest footprint of one step, split the way the runbooks reason about it."""

    step: int
    phase: Phase
    allocated: int
    reserved_unallocated: int

    @property
    def process_in_use(self) -> int:
        return self.allocated + self.reserved_unallocated + NON_PYTORCH_BYTES


def _shard(nbytes: int, degree: int) -> int:
    return math.ceil(nbytes / degree)


def params_on_rank(config: TrainConfig) -> int:
    return _shard(config.shape.params, config.tensor_parallel * config.pipeline_parallel)


def weights_bytes(config: TrainConfig) -> int:
    full = params_on_rank(config) * BYTES_WEIGHTS
    return _shard(full, config.data_parallel) if config.zero_stage >= 3 else full


def grads_bytes(config: TrainConfig) -> int:
    full = params_on_rank(config) * BYTES_GRADS
    return _shard(full, config.data_parallel) if config.zero_stage >= 2 else full


def _optimizer_shard(config: TrainConfig, bytes_per_param: int) -> int:
    if config.offload_optimizer:
        return 0
    full = params_on_rank(config) * bytes_per_param
    return _shard(full, config.data_parallel) if config.zero_stage >= 1 else full


def master_bytes(config: TrainConfig) -> int:
    return _optimizer_shard(config, BYTES_MASTER)


def adam_moments_bytes(config: TrainConfig) -> int:
    per_param = BYTES_ADAM_MOMENTS_8BIT if config.optimizer_8bit else BYTES_ADAM_MOMENTS
    return _optimizer_shard(config, per_param)


def adam_update_temp_bytes(config: TrainConfig) -> int:
    """One of the fp32 lists the multi-tensor update allocates (the request that fails)."""
    if config.optimizer_8bit:
        return 0
    return _optimizer_shard(config, BYTES_ADAM_UPDATE_TEMP)


def resident_bytes(config: TrainConfig, *, with_moments: bool) -> int:
    """Weights, gradients and optimizer state that live on the card for the whole run."""
    moments = adam_moments_bytes(config) if with_moments else 0
    return weights_bytes(config) + grads_bytes(config) + master_bytes(config) + moments


def seq_at_step(config: TrainConfig, step: int) -> int:
    """The padded sequence length of the step's batch: longer at the known longest batch."""
    if config.longest_batch_step == step:
        return int(config.shape.seq_length * config.longest_batch_factor)
    return config.shape.seq_length


def layer_linear_bytes(config: TrainConfig, seq: int) -> int:
    shape, t = config.shape, config.tensor_parallel
    sbh = seq * config.micro_batch * shape.hidden_size
    return sbh * 10 + sbh * 24 // t


def layer_attention_bytes(config: TrainConfig, seq: int) -> int:
    shape = config.shape
    return 5 * shape.num_heads * seq * seq * config.micro_batch // config.tensor_parallel


def layer_input_bytes(config: TrainConfig, seq: int) -> int:
    return 2 * seq * config.micro_batch * config.shape.hidden_size


def logits_bytes(config: TrainConfig, seq: int) -> int:
    """fp32 logits for the loss, split over tensor-parallel ranks."""
    shape = config.shape
    return seq * config.micro_batch * shape.vocab_size * 4 // config.tensor_parallel


def _checkpointed_layers(config: TrainConfig) -> int:
    if config.recompute is not Recompute.FULL:
        return 0
    layers = config.shape.num_layers
    if config.recompute_num_layers is None:
        return layers
    return min(layers, config.recompute_num_layers)


def forward_allocations(config: TrainConfig, seq: int) -> list[Allocation]:
    """What forward keeps for backward, layer by layer, then the logits."""
    allocations: list[Allocation] = []
    checkpointed = _checkpointed_layers(config)
    for layer in range(config.shape.num_layers):
        if layer < checkpointed:
            allocations.append(
                Allocation(Phase.FORWARD, AllocKind.LINEAR, layer_input_bytes(config, seq))
            )
            continue
        allocations.append(
            Allocation(Phase.FORWARD, AllocKind.LINEAR, layer_linear_bytes(config, seq))
        )
        if config.recompute is not Recompute.SELECTIVE:
            allocations.append(
                Allocation(Phase.FORWARD, AllocKind.ATTENTION, layer_attention_bytes(config, seq))
            )
    allocations.append(Allocation(Phase.FORWARD, AllocKind.LOGITS, logits_bytes(config, seq)))
    return allocations


def activation_bytes(config: TrainConfig, seq: int | None = None) -> int:
    """Everything forward keeps for backward at sequence length `seq` (default: the config's)."""
    length = config.shape.seq_length if seq is None else seq
    return sum(allocation.nbytes for allocation in forward_allocations(config, length))


def backward_allocations(config: TrainConfig, seq: int) -> list[Allocation]:
    """The transient peak of backward: a recomputed layer, then a layer's activation gradient."""
    events: list[Allocation] = []
    if config.recompute is Recompute.FULL:
        recomputed = layer_linear_bytes(config, seq) + layer_attention_bytes(config, seq)
        events.append(Allocation(Phase.BACKWARD, AllocKind.RECOMPUTE, recomputed))
    elif config.recompute is Recompute.SELECTIVE:
        events.append(
            Allocation(Phase.BACKWARD, AllocKind.RECOMPUTE, layer_attention_bytes(config, seq))
        )
    events.append(
        Allocation(Phase.BACKWARD, AllocKind.ACTIVATION_GRAD, layer_linear_bytes(config, seq))
    )
    return events


def tail_bytes(config: TrainConfig, steps_in_process: int) -> int:
    """Reserved-but-unallocated memory after `steps_in_process` steps of this process."""
    ramp = min(1.0, max(0, steps_in_process - 1) / TAIL_RAMP_STEPS)
    share = ROUNDING_SLACK_SHARE + config.fragmentation * config.allocator.tail_share() * ramp
    return int(activation_bytes(config) * share)


def eval_batches(config: TrainConfig) -> int:
    return math.ceil(config.eval_samples / config.eval_batch)


def kv_cache_bytes(config: TrainConfig) -> int:
    """K and V in bf16 for every layer of one eval batch, at prompt plus generated length."""
    shape = config.shape
    length = shape.seq_length + config.generate_tokens
    per_sample = 2 * shape.num_layers * length * shape.hidden_size * 2 // config.tensor_parallel
    return config.eval_batch * per_sample


def eval_predictions_bytes(config: TrainConfig) -> int:
    """One eval batch's bf16 logits, which the evaluation loop gathers on the GPU."""
    shape = config.shape
    return config.eval_batch * shape.seq_length * shape.vocab_size * 2 // config.tensor_parallel


def eval_allocations(config: TrainConfig) -> list[Allocation | Release]:
    """Each eval batch: its KV cache and logits, then the gather into one growing buffer.

    Without eval_accumulation_steps the gathered predictions stay on the GPU to the end;
    with it they move to the host every that many batches.
    """
    events: list[Allocation | Release] = []
    per_batch = eval_predictions_bytes(config)
    kv = kv_cache_bytes(config)
    held = 0
    for batch in range(1, eval_batches(config) + 1):
        events.append(Allocation(Phase.EVAL, AllocKind.KV_CACHE, kv))
        events.append(Allocation(Phase.EVAL, AllocKind.LOGITS, per_batch))
        events.append(Release(kv))
        events.append(Allocation(Phase.EVAL, AllocKind.EVAL_GATHER, held + per_batch))
        events.append(Release(held + per_batch))
        held += per_batch
        accumulation = config.eval_accumulation_steps
        if accumulation is not None and batch % accumulation == 0:
            events.append(Release(held))
            held = 0
    events.append(Release(held))
    return events


def is_eval_step(config: TrainConfig, step: int) -> bool:
    return config.eval_every is not None and step % config.eval_every == 0


def step_events(
    config: TrainConfig, step: int, *, moments_present: bool
) -> Iterator[Allocation | Release]:
    """Every allocation and release of one training step (and its eval, if one is due)."""
    seq = seq_at_step(config, step)
    forward = forward_allocations(config, seq)
    yield from forward
    yield from backward_transients(config, seq)
    yield Release(sum(allocation.nbytes for allocation in forward))
    if moments_present:
        temp = adam_update_temp_bytes(config)
        for _ in range(ADAM_UPDATE_TEMP_LISTS):
            yield Allocation(Phase.OPTIMIZER, AllocKind.ADAM_UPDATE, temp)
        yield Release(temp * ADAM_UPDATE_TEMP_LISTS)
    else:
        per_layer = math.ceil(adam_moments_bytes(config) / config.shape.num_layers)
        for _ in range(config.shape.num_layers):
            yield Allocation(Phase.OPTIMIZER, AllocKind.ADAM_STATE, per_layer)
    if is_eval_step(config, step):
        yield from eval_allocations(config)


def backward_transients(config: TrainConfig, seq: int) -> Iterator[Allocation | Release]:
    """Backward's transient allocations, released together once backward is done."""
    allocations = backward_allocations(config, seq)
    yield from allocations
    yield Release(sum(allocation.nbytes for allocation in allocations))


def setup_allocations(config: TrainConfig, *, resumed: bool) -> list[Allocation]:
    """Loading the model (and, on resume, the optimizer state) onto the card, layer by layer."""
    resident = resident_bytes(config, with_moments=resumed)
    per_layer = math.ceil(resident / config.shape.num_layers)
    return [
        Allocation(Phase.SETUP, AllocKind.WEIGHTS, per_layer)
        for _ in range(config.shape.num_layers)
    ]


@dataclass(frozen=True)
class RunOutcome:
    """How a run from `start_step` goes on one card: the OOM if any, and the worst step."""

    oom: OomEvent | None
    peak: StepPeak | None


def simulate(config: TrainConfig, card: Card, *, start_step: int = 0) -> RunOutcome:
    """Walk the run from the step after `start_step` to max_steps on `card`.

    Returns the first allocation that does not fit, or none, and the step with the largest
    footprint seen. Resuming (start_step > 0) loads Adam's moments at setup and starts a
    fresh allocator, so the fragmentation tail grows again from nothing.
    """
    resumed = start_step > 0
    headroom = card.total_bytes - NON_PYTORCH_BYTES - card.cotenant_bytes
    allocated = 0
    peak: StepPeak | None = None

    def oom(step: int, allocation: Allocation, tail: int) -> OomEvent:
        return OomEvent(
            step=step,
            phase=allocation.phase,
            kind=allocation.kind,
            requested=allocation.nbytes,
            allocated=allocated,
            reserved_unallocated=tail,
            non_pytorch=NON_PYTORCH_BYTES,
            cotenant=card.cotenant_bytes,
            total=card.total_bytes,
        )

    for allocation in setup_allocations(config, resumed=resumed):
        if allocated + allocation.nbytes > headroom:
            return RunOutcome(oom(start_step + 1, allocation, 0), None)
        allocated += allocation.nbytes
    moments_present = resumed
    for step in range(start_step + 1, config.max_steps + 1):
        tail = tail_bytes(config, step - start_step)
        step_peak = allocated
        phase = Phase.FORWARD
        for event in step_events(config, step, moments_present=moments_present):
            if isinstance(event, Release):
                allocated -= event.nbytes
                continue
            if allocated + tail + event.nbytes > headroom:
                return RunOutcome(oom(step, event, tail), peak)
            allocated += event.nbytes
            if allocated > step_peak:
                step_peak = allocated
                phase = event.phase
        moments_present = True
        if peak is None or step_peak + tail > peak.allocated + peak.reserved_unallocated:
            peak = StepPeak(step, phase, step_peak, tail)
    return RunOutcome(None, peak)


@dataclass(frozen=True)
class HostRam:
    """Host memory of one node: the main process and each dataloader worker per rank."""

    budget_bytes: int = 256 * GIB
    main_process_bytes: int = 8 * GIB
    per_worker_bytes: int = 2 * GIB


def host_ram_bytes(config: TrainConfig, host: HostRam, ranks_per_node: int) -> int:
    per_rank = host.main_process_bytes + config.dataloader_workers * host.per_worker_bytes
    return ranks_per_node * per_rank


def host_ram_exceeded(config: TrainConfig, host: HostRam, ranks_per_node: int) -> bool:
    return host_ram_bytes(config, host, ranks_per_node) > host.budget_bytes
