"""Megatron-LM / NeMo: the micro-batch moves under a fixed `--global-batch-size`.

Megatron derives gradient accumulation itself (global / (micro x data-parallel)), so a
patch only ever changes `--micro-batch-size`; the global batch, and the science, stay put.
"""

from __future__ import annotations

from daemon.dialects.base import (
    COMMON_DEFAULTS,
    COMMON_KNOBS,
    COMMON_ROLES,
    RECOMPUTE_FULL,
    RECOMPUTE_NONE,
    RECOMPUTE_SELECTIVE,
    Dialect,
    KnobKind,
    Knobs,
    KnobSpec,
    Role,
    flag_if,
    integer,
    no_config,
    text,
)

_RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "mla_up_proj")


def _args(knobs: Knobs) -> tuple[str, ...]:
    args = [
        "--micro-batch-size",
        str(integer(knobs, "micro_batch_size")),
        "--global-batch-size",
        str(integer(knobs, "global_batch_size")),
        "--tensor-model-parallel-size",
        str(integer(knobs, "tensor_model_parallel_size")),
        "--pipeline-model-parallel-size",
        str(integer(knobs, "pipeline_model_parallel_size")),
        "--seq-length",
        str(integer(knobs, "seq_length")),
    ]
    granularity = text(knobs, "recompute_granularity")
    if granularity != RECOMPUTE_NONE:
        args += ["--recompute-granularity", granularity]
    if granularity == RECOMPUTE_FULL:
        args += ["--recompute-method", text(knobs, "recompute_method")]
        args += ["--recompute-num-layers", str(integer(knobs, "recompute_num_layers"))]
    modules = knobs["recompute_modules"]
    if granularity == RECOMPUTE_SELECTIVE and isinstance(modules, tuple) and modules:
        args += ["--recompute-modules", *(str(module) for module in modules)]
    args += flag_if(bool(knobs["use_distributed_optimizer"]), "--use-distributed-optimizer")
    args += ["--num-workers", str(integer(knobs, "num_workers"))]
    resume = text(knobs, "load")
    args += flag_if(bool(resume), "--load", resume)
    return tuple(args)


DIALECT = Dialect(
    name="megatron",
    title="Megatron-LM / NeMo",
    knobs=(
        *COMMON_KNOBS,
        KnobSpec("micro_batch_size", KnobKind.INT, "micro-batch per GPU", 1, 65536),
        KnobSpec("global_batch_size", KnobKind.INT, "samples per optimizer step (fixed)", 1),
        KnobSpec("tensor_model_parallel_size", KnobKind.INT, "tensor-parallel degree", 1, 64),
        KnobSpec("pipeline_model_parallel_size", KnobKind.INT, "pipeline stages", 1, 1024),
        KnobSpec("seq_length", KnobKind.INT, "tokens per sample", 1, 10_000_000),
        KnobSpec(
            "recompute_granularity",
            KnobKind.ENUM,
            "activation recompute",
            choices=(RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL),
        ),
        KnobSpec("recompute_method", KnobKind.ENUM, "full recompute", choices=("uniform", "block")),
        KnobSpec("recompute_num_layers", KnobKind.INT, "layers per recompute unit", 1, 1024),
        KnobSpec(
            "recompute_modules", KnobKind.NAMES, "selective modules", choices=_RECOMPUTE_MODULES
        ),
        KnobSpec("use_distributed_optimizer", KnobKind.BOOL, "shard optimizer state (ZeRO-1)"),
        KnobSpec("num_workers", KnobKind.INT, "dataloader processes per rank", 0, 256),
        KnobSpec("load", KnobKind.TEXT, "checkpoint directory to resume from"),
    ),
    roles={
        **COMMON_ROLES,
        Role.MICRO_BATCH: "micro_batch_size",
        Role.GLOBAL_BATCH: "global_batch_size",
        Role.TENSOR_PARALLEL: "tensor_model_parallel_size",
        Role.PIPELINE_PARALLEL: "pipeline_model_parallel_size",
        Role.RECOMPUTE: "recompute_granularity",
        Role.SHARDING: "use_distributed_optimizer",
        Role.WORKERS: "num_workers",
        Role.SEQ_LENGTH: "seq_length",
        Role.RESUME: "load",
    },
    defaults={
        **COMMON_DEFAULTS,
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "seq_length": 2048,
        "recompute_granularity": RECOMPUTE_NONE,
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "recompute_modules": (),
        "use_distributed_optimizer": False,
        "num_workers": 2,
        "load": "",
    },
    render_args=_args,
    render_env=lambda _knobs: (),
    render_config=no_config,
    global_batch_fixed=True,
    invariant=(
        "global_batch_size = micro_batch_size x accumulation x data-parallel, "
        "data-parallel = nodes x gpus / (tensor x pipeline); accumulation is implied"
    ),
    resume_note="--load CHECKPOINT_ROOT (Megatron reads latest_checkpointed_iteration.txt there)",
    recognise_flags={
        "--micro-batch-size": "micro_batch_size",
        "--global-batch-size": "global_batch_size",
        "--tensor-model-parallel-size": "tensor_model_parallel_size",
        "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
        "--seq-length": "seq_length",
        "--recompute-granularity": "recompute_granularity",
        "--recompute-method": "recompute_method",
        "--recompute-num-layers": "recompute_num_layers",
        "--recompute-modules": "recompute_modules",
        "--use-distributed-optimizer": "use_distributed_optimizer",
        "--num-workers": "num_workers",
        "--load": "load",
    },
    full_recompute_extras={"recompute_method": "uniform", "recompute_num_layers": 1},
)
