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


# Knobs a script may not read at all: left out of the environment unless set.
_OPTIONAL = (
    KnobSpec("eval_batch_size", KnobKind.INT, "eval batch per GPU", 1, 65536, unset=0),
    KnobSpec("num_workers", KnobKind.INT, "dataloader processes per rank", 0, 256, unset=-1),
    KnobSpec("seq_len", KnobKind.INT, "tokens per sample", 1, 10_000_000, unset=0),
)
_SPECS = {spec.name: spec for spec in _OPTIONAL}


def _env(knobs: Knobs) -> tuple[tuple[str, str], ...]:
    values = {
        "micro_batch_size": str(integer(knobs, "micro_batch_size")),
        "grad_accum_steps": str(integer(knobs, "grad_accum_steps")),
    }
    recompute = text(knobs, "activation_checkpointing")
    if recompute != RECOMPUTE_NONE:
        values["activation_checkpointing"] = recompute
    if knobs["shard_optimizer"]:
        values["shard_optimizer"] = "1"
    for knob in ("eval_batch_size", "num_workers", "seq_len"):
        if integer(knobs, knob) >= 0 and _SPECS[knob].is_set(knobs[knob]):
            values[knob] = str(integer(knobs, knob))
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
        *_OPTIONAL,
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
        "eval_batch_size": 0,
        "num_workers": -1,
        "seq_len": 0,
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
