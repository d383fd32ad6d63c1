"""Every knob of one emulated run, the scenario presets, and how they become a TrainConfig.

Precedence, lowest first: built-in defaults, the scenario preset, then what the launch
command says (the dialect's flags and environment, and the emulation's own flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from emulation.model import (
    GIB,
    AllocatorConf,
    HostRam,
    ModelShape,
    Recompute,
    TrainConfig,
)


class Dialect(StrEnum):
    HF = "hf"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"
    TORCHRUN = "torchrun"


@dataclass(frozen=True)
class Settings:
    """The resolved knobs; `train_config` turns the memory-relevant ones into a TrainConfig."""

    dialect: Dialect = Dialect.TORCHRUN
    scenario: str | None = None
    num_layers: int = 24
    hidden_size: int = 2048
    num_heads: int = 16
    vocab_size: int = 50304
    seq_length: int = 2048
    micro_batch: int = 2
    grad_accum: int = 4
    global_batch: int | None = None
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
    host_ram_gib: float = 256.0
    host_main_process_gib: float = 8.0
    host_per_worker_gib: float = 2.0
    max_steps: int = 12
    save_every: int | None = 2
    output_dir: str | None = None
    resume_from: str | None = None
    resume_tag: str | None = None
    card_gib: float = 80.0
    step_seconds: float = 0.2
    save_seconds: float = 0.05
    nccl_timeout_seconds: float = 60.0
    oom_rank: int | None = None

    def train_config(self, world_size: int) -> TrainConfig:
        """The memory model's view; grad-accum follows from a global batch where one is given."""
        data_parallel = max(1, world_size // (self.tensor_parallel * self.pipeline_parallel))
        grad_accum = self.grad_accum
        if self.global_batch is not None:
            grad_accum = max(1, self.global_batch // (self.micro_batch * data_parallel))
        return TrainConfig(
            shape=ModelShape(
                num_layers=self.num_layers,
                hidden_size=self.hidden_size,
                num_heads=self.num_heads,
                vocab_size=self.vocab_size,
                seq_length=self.seq_length,
            ),
            micro_batch=self.micro_batch,
            grad_accum=grad_accum,
            world_size=world_size,
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            recompute=self.recompute,
            recompute_num_layers=self.recompute_num_layers,
            zero_stage=self.zero_stage,
            offload_optimizer=self.offload_optimizer,
            optimizer_8bit=self.optimizer_8bit,
            allocator=self.allocator,
            fragmentation=self.fragmentation,
            eval_batch=self.eval_batch,
            eval_accumulation_steps=self.eval_accumulation_steps,
            eval_samples=self.eval_samples,
            eval_every=self.eval_every,
            generate_tokens=self.generate_tokens,
            longest_batch_step=self.longest_batch_step,
            longest_batch_factor=self.longest_batch_factor,
            dataloader_workers=self.dataloader_workers,
            max_steps=self.max_steps,
        )

    def host_ram(self) -> HostRam:
        return HostRam(
            budget_bytes=int(self.host_ram_gib * GIB),
            main_process_bytes=int(self.host_main_process_gib * GIB),
            per_worker_bytes=int(self.host_per_worker_gib * GIB),
        )


# Presets are sized for 4 ranks (one per node) on 80 GiB cards; README.md gives each one's
# figures, its first fix, and why that fix works in the model.
_PRESET_1B3: dict[str, Any] = {
    "num_layers": 24,
    "hidden_size": 2048,
    "num_heads": 16,
    "vocab_size": 50304,
    "seq_length": 2048,
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "fragmentation": {**_PRESET_1B3, "micro_batch": 4, "grad_accum": 4, "fragmentation": 0.3},
    # A 64k vocabulary makes the logits of 6 samples (3 GiB) more than the card has left even
    # counting its reserved-but-unallocated bytes, so the runbooks' rule reads a true OOM, not
    # fragmentation (with V 50304 the 2.30 GiB request fitted in free + unallocated).
    "true-oom-step0": {**_PRESET_1B3, "vocab_size": 65536, "micro_batch": 6, "grad_accum": 4},
    "true-oom-midrun": {
        **_PRESET_1B3,
        "micro_batch": 4,
        "grad_accum": 4,
        "longest_batch_step": 7,
        "longest_batch_factor": 1.5,
        # A small tail, so that the longest batch fails on capacity alone: allocated plus the
        # request exceed the card, and the message shows less unallocated than was asked.
        "fragmentation": 0.02,
    },
    "optimizer-burst": {
        "num_layers": 32,
        "hidden_size": 3072,
        "num_heads": 24,
        "vocab_size": 50304,
        "seq_length": 1024,
        "micro_batch": 2,
        "grad_accum": 16,
    },
    "eval-growth": {
        **_PRESET_1B3,
        "micro_batch": 2,
        "grad_accum": 8,
        "fragmentation": 0.05,
        "eval_every": 4,
        "eval_batch": 32,
        "eval_samples": 64,
        "generate_tokens": 6144,
    },
    "faulty-node": {**_PRESET_1B3, "micro_batch": 3, "grad_accum": 4},
    "cotenant": {**_PRESET_1B3, "micro_batch": 3, "grad_accum": 4},
    "host-ram": {
        **_PRESET_1B3,
        "micro_batch": 2,
        "grad_accum": 8,
        "dataloader_workers": 16,
        "host_ram_gib": 128.0,
        "host_per_worker_gib": 12.0,
    },
}


def apply_scenario(settings: Settings, name: str) -> Settings:
    """The preset's knobs over `settings`; an unknown name is an error naming the known ones."""
    try:
        preset = SCENARIOS[name]
    except KeyError:
        known = ", ".join(sorted(SCENARIOS))
        raise ValueError(f"unknown scenario {name!r}; known: {known}") from None
    return replace(settings, scenario=name, **preset)
