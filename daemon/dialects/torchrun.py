"""Plain torchrun: the training script reads its knobs from environment variables."""

from __future__ import annotations

from collections.abc import Mapping

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
    integer,
    text,
)

# knob name -> the variable the training script reads
ENV_NAMES: Mapping[str, str] = {
    "micro_batch_size": "MICRO_BATCH_SIZE",
    "grad_accum_steps": "GRAD_ACCUM_STEPS",
    "activation_checkpointing": "ACTIVATION_CHECKPOINTING",
    "shard_optimizer": "SHARD_OPTIMIZER",
    "eval_batch_size": "EVAL_BATCH_SIZE",
    "num_workers": "NUM_WORKERS",
    "seq_len": "SEQ_LEN",
    "resume_from": "RESUME_FROM",
}


def _env(knobs: Knobs) -> tuple[tuple[str, str], ...]:
    values = {
        "micro_batch_size": str(integer(knobs, "micro_batch_size")),
        "grad_accum_steps": str(integer(knobs, "grad_accum_steps")),
        "activation_checkpointing": text(knobs, "activation_checkpointing"),
        "shard_optimizer": "1" if knobs["shard_optimizer"] else "0",
        "eval_batch_size": str(integer(knobs, "eval_batch_size")),
        "num_workers": str(integer(knobs, "num_workers")),
        "seq_len": str(integer(knobs, "seq_len")),
    }
    resume = text(knobs, "resume_from")
    if resume:
        values["resume_from"] = resume
    return tuple((ENV_NAMES[knob], value) for knob, value in values.items())


def _no_config(_knobs: Knobs, _base: Mapping[str, object]) -> str | None:
    return None


DIALECT = Dialect(
    name="torchrun",
    title="torchrun with environment knobs",
    knobs=(
        *COMMON_KNOBS,
        KnobSpec("micro_batch_size", KnobKind.INT, "micro-batch per GPU", 1, 65536),
        KnobSpec("grad_accum_steps", KnobKind.INT, "micro-batches per step", 1, 65536),
        KnobSpec(
            "activation_checkpointing",
            KnobKind.ENUM,
            "activation recompute",
            choices=(RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL),
        ),
        KnobSpec("shard_optimizer", KnobKind.BOOL, "ZeroRedundancyOptimizer / FSDP optimizer"),
        KnobSpec("eval_batch_size", KnobKind.INT, "eval batch per GPU", 1, 65536),
        KnobSpec("num_workers", KnobKind.INT, "dataloader processes per rank", 0, 256),
        KnobSpec("seq_len", KnobKind.INT, "tokens per sample", 1, 10_000_000),
        KnobSpec("resume_from", KnobKind.TEXT, "DCP checkpoint directory to resume from"),
    ),
    roles={
        **COMMON_ROLES,
        Role.MICRO_BATCH: "micro_batch_size",
        Role.GRAD_ACCUM: "grad_accum_steps",
        Role.RECOMPUTE: "activation_checkpointing",
        Role.SHARDING: "shard_optimizer",
        Role.EVAL_BATCH: "eval_batch_size",
        Role.WORKERS: "num_workers",
        Role.SEQ_LENGTH: "seq_len",
        Role.RESUME: "resume_from",
    },
    defaults={
        **COMMON_DEFAULTS,
        "micro_batch_size": 1,
        "grad_accum_steps": 1,
        "activation_checkpointing": RECOMPUTE_NONE,
        "shard_optimizer": False,
        "eval_batch_size": 1,
        "num_workers": 2,
        "seq_len": 2048,
        "resume_from": "",
    },
    render_args=lambda _knobs: (),
    render_env=_env,
    render_config=_no_config,
    global_batch_fixed=False,
    invariant="global = MICRO_BATCH_SIZE x GRAD_ACCUM_STEPS x nodes x gpus",
    resume_note="RESUME_FROM=CHECKPOINT_DIR in the environment",
    recognise_env={variable: knob for knob, variable in ENV_NAMES.items()},
)
