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
    no_config,
    text,
)

# knob name -> the variable the training script reads
ENV_NAMES: Mapping[str, str] = {
    "micro_batch": "MICRO_BATCH",
    "grad_accum": "GRAD_ACCUM",
    "recompute": "RECOMPUTE",
    "zero_stage": "ZERO_STAGE",
    "eval_batch": "EVAL_BATCH",
    "eval_accum": "EVAL_ACCUM",
    "num_workers": "NUM_WORKERS",
    "seq_len": "SEQ_LEN",
    "resume_from": "RESUME_FROM",
}


# Knobs a script may not read at all: left out of the environment unless set.
_OPTIONAL = (
    KnobSpec("eval_batch", KnobKind.INT, "eval batch per GPU", 1, 65536, unset=0),
    KnobSpec("eval_accum", KnobKind.INT, "offload eval outputs every N", 1, 65536, unset=0),
    KnobSpec("num_workers", KnobKind.INT, "dataloader processes per rank", 0, 256, unset=-1),
    KnobSpec("seq_len", KnobKind.INT, "tokens per sample", 1, 10_000_000, unset=0),
)
_SPECS = {spec.name: spec for spec in _OPTIONAL}


def _env(knobs: Knobs) -> tuple[tuple[str, str], ...]:
    values = {
        "micro_batch": str(integer(knobs, "micro_batch")),
        "grad_accum": str(integer(knobs, "grad_accum")),
    }
    recompute = text(knobs, "recompute")
    if recompute != RECOMPUTE_NONE:
        values["recompute"] = recompute
    for knob in ("zero_stage", *_SPECS):
        if knob == "zero_stage" or _SPECS[knob].is_set(knobs[knob]):
            values[knob] = str(integer(knobs, knob))
    resume = text(knobs, "resume_from")
    if resume:
        values["resume_from"] = resume
    return tuple((ENV_NAMES[knob], value) for knob, value in values.items())


DIALECT = Dialect(
    name="torchrun",
    title="torchrun with environment knobs",
    knobs=(
        *COMMON_KNOBS,
        KnobSpec("micro_batch", KnobKind.INT, "micro-batch per GPU", 1, 65536),
        KnobSpec("grad_accum", KnobKind.INT, "micro-batches per step", 1, 65536),
        KnobSpec(
            "recompute",
            KnobKind.ENUM,
            "activation recompute",
            choices=(RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL),
        ),
        KnobSpec("zero_stage", KnobKind.INT, "optimizer/gradient sharding stage", 0, 3),
        *_OPTIONAL,
        KnobSpec("resume_from", KnobKind.TEXT, "DCP checkpoint directory to resume from"),
    ),
    roles={
        **COMMON_ROLES,
        Role.MICRO_BATCH: "micro_batch",
        Role.GRAD_ACCUM: "grad_accum",
        Role.RECOMPUTE: "recompute",
        Role.SHARDING: "zero_stage",
        Role.EVAL_BATCH: "eval_batch",
        Role.EVAL_ACCUM: "eval_accum",
        Role.WORKERS: "num_workers",
        Role.SEQ_LENGTH: "seq_len",
        Role.RESUME: "resume_from",
    },
    defaults={
        **COMMON_DEFAULTS,
        "micro_batch": 1,
        "grad_accum": 1,
        "recompute": RECOMPUTE_NONE,
        "zero_stage": 0,
        "eval_batch": 0,
        "eval_accum": 0,
        "num_workers": -1,
        "seq_len": 0,
        "resume_from": "",
    },
    render_args=lambda _knobs: (),
    render_env=_env,
    render_config=no_config,
    global_batch_fixed=False,
    invariant="global = MICRO_BATCH x GRAD_ACCUM x nodes x gpus",
    resume_note="RESUME_FROM=CHECKPOINT_DIR in the environment",
    recognise_env={variable: knob for knob, variable in ENV_NAMES.items()},
)
