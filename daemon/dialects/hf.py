"""Hugging Face Trainer: `TrainingArguments` flags on the command line of the training script."""

from __future__ import annotations

from daemon.dialects.base import (
    COMMON_DEFAULTS,
    COMMON_KNOBS,
    COMMON_ROLES,
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

_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "adafactor", "sgd")


def _args(knobs: Knobs) -> tuple[str, ...]:
    args = [
        "--per_device_train_batch_size",
        str(integer(knobs, "per_device_train_batch_size")),
        "--gradient_accumulation_steps",
        str(integer(knobs, "gradient_accumulation_steps")),
        *flag_if(bool(knobs["gradient_checkpointing"]), "--gradient_checkpointing"),
        "--per_device_eval_batch_size",
        str(integer(knobs, "per_device_eval_batch_size")),
    ]
    eval_accumulation = integer(knobs, "eval_accumulation_steps")
    args += flag_if(eval_accumulation > 0, "--eval_accumulation_steps", str(eval_accumulation))
    args += ["--dataloader_num_workers", str(integer(knobs, "dataloader_num_workers"))]
    optimizer = text(knobs, "optim")
    args += flag_if(bool(optimizer), "--optim", optimizer)
    generation = integer(knobs, "generation_max_length")
    args += flag_if(generation > 0, "--generation_max_length", str(generation))
    sequence = integer(knobs, "max_seq_length")
    args += flag_if(sequence > 0, "--max_seq_length", str(sequence))
    resume = text(knobs, "resume_from_checkpoint")
    args += flag_if(bool(resume), "--resume_from_checkpoint", resume)
    return tuple(args)


DIALECT = Dialect(
    name="hf",
    title="Hugging Face Trainer",
    knobs=(
        *COMMON_KNOBS,
        KnobSpec("per_device_train_batch_size", KnobKind.INT, "micro-batch per GPU", 1, 65536),
        KnobSpec("gradient_accumulation_steps", KnobKind.INT, "micro-batches per step", 1, 65536),
        KnobSpec("gradient_checkpointing", KnobKind.BOOL, "recompute activations (full)"),
        KnobSpec("per_device_eval_batch_size", KnobKind.INT, "eval batch per GPU", 1, 65536),
        KnobSpec(
            "eval_accumulation_steps", KnobKind.INT, "offload eval outputs every N (0: off)", 0
        ),
        KnobSpec("dataloader_num_workers", KnobKind.INT, "dataloader processes per rank", 0, 256),
        KnobSpec("optim", KnobKind.ENUM, "optimizer", choices=_OPTIMIZERS, unset=""),
        KnobSpec(
            "generation_max_length", KnobKind.INT, "tokens generated in eval", 1, 10**7, unset=0
        ),
        KnobSpec("max_seq_length", KnobKind.INT, "tokens per sample (TRL)", 1, 10**7, unset=0),
        KnobSpec("resume_from_checkpoint", KnobKind.TEXT, "checkpoint-N directory to resume"),
    ),
    roles={
        **COMMON_ROLES,
        Role.MICRO_BATCH: "per_device_train_batch_size",
        Role.GRAD_ACCUM: "gradient_accumulation_steps",
        Role.RECOMPUTE: "gradient_checkpointing",
        Role.EVAL_BATCH: "per_device_eval_batch_size",
        Role.EVAL_ACCUM: "eval_accumulation_steps",
        Role.GENERATION_LENGTH: "generation_max_length",
        Role.WORKERS: "dataloader_num_workers",
        Role.OPTIMIZER: "optim",
        Role.SEQ_LENGTH: "max_seq_length",
        Role.RESUME: "resume_from_checkpoint",
    },
    defaults={
        **COMMON_DEFAULTS,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "per_device_eval_batch_size": 8,
        "eval_accumulation_steps": 0,
        "dataloader_num_workers": 0,
        "optim": "",
        "generation_max_length": 0,
        "max_seq_length": 0,
        "resume_from_checkpoint": "",
    },
    render_args=_args,
    render_env=lambda _knobs: (),
    render_config=no_config,
    global_batch_fixed=False,
    invariant="global = per_device_train_batch_size x gradient_accumulation_steps x nodes x gpus",
    resume_note="--resume_from_checkpoint OUTPUT_DIR/checkpoint-N",
    recognise_flags={
        "--per_device_train_batch_size": "per_device_train_batch_size",
        "--gradient_accumulation_steps": "gradient_accumulation_steps",
        "--gradient_checkpointing": "gradient_checkpointing",
        "--per_device_eval_batch_size": "per_device_eval_batch_size",
        "--eval_accumulation_steps": "eval_accumulation_steps",
        "--dataloader_num_workers": "dataloader_num_workers",
        "--optim": "optim",
        "--max_seq_length": "max_seq_length",
        "--generation_max_length": "generation_max_length",
        "--resume_from_checkpoint": "resume_from_checkpoint",
    },
)
