"""DeepSpeed: batch and ZeRO knobs live in the config JSON, rendered from the knobs.

The JSON is written by the job script through a quoted heredoc: json.dumps escapes every
newline inside strings, so no line of it can end the heredoc early.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

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
    text,
)

_OFFLOAD = ("none", "cpu", "nvme")


def _gpus(knobs: Knobs) -> int:
    return integer(knobs, "nodes") * integer(knobs, "gpus_per_node")


def _config(knobs: Knobs, base: Mapping[str, object]) -> str | None:
    config: dict[str, object] = dict(base)
    micro = integer(knobs, "train_micro_batch_size_per_gpu")
    accum = integer(knobs, "gradient_accumulation_steps")
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accum
    config["train_batch_size"] = micro * accum * _gpus(knobs)
    existing = base.get("zero_optimization")
    zero: dict[str, object] = dict(existing) if isinstance(existing, Mapping) else {}
    zero["stage"] = integer(knobs, "zero_stage")
    for key in ("offload_optimizer", "offload_param"):
        device = text(knobs, key)
        if device == "none":
            zero.pop(key, None)
        else:
            zero[key] = {"device": device}
    config["zero_optimization"] = zero
    return json.dumps(config, indent=2, sort_keys=True, ensure_ascii=True)


def _args(knobs: Knobs) -> tuple[str, ...]:
    workers = integer(knobs, "num_workers")
    args = [
        *flag_if(bool(knobs["gradient_checkpointing"]), "--gradient_checkpointing"),
        *flag_if(workers >= 0, "--num_workers", str(workers)),
    ]
    resume = text(knobs, "load_dir")
    args += flag_if(bool(resume), "--load_dir", resume)
    tag = text(knobs, "load_tag")
    args += flag_if(bool(resume) and bool(tag), "--ckpt_tag", tag)
    return tuple(args)


DIALECT = Dialect(
    name="deepspeed",
    title="DeepSpeed (config JSON)",
    knobs=(
        *COMMON_KNOBS,
        KnobSpec("train_micro_batch_size_per_gpu", KnobKind.INT, "micro-batch per GPU", 1, 65536),
        KnobSpec("gradient_accumulation_steps", KnobKind.INT, "micro-batches per step", 1, 65536),
        KnobSpec("zero_stage", KnobKind.INT, "ZeRO partitioning stage", 0, 3),
        KnobSpec("offload_optimizer", KnobKind.ENUM, "optimizer state offload", choices=_OFFLOAD),
        KnobSpec("offload_param", KnobKind.ENUM, "parameter offload (stage 3)", choices=_OFFLOAD),
        KnobSpec("gradient_checkpointing", KnobKind.BOOL, "recompute activations (full)"),
        KnobSpec("num_workers", KnobKind.INT, "dataloader processes per rank", 0, 256, unset=-1),
        KnobSpec("load_dir", KnobKind.TEXT, "checkpoint directory to resume from"),
        KnobSpec("load_tag", KnobKind.TEXT, "checkpoint tag (empty: the `latest` file)"),
    ),
    roles={
        **COMMON_ROLES,
        Role.MICRO_BATCH: "train_micro_batch_size_per_gpu",
        Role.GRAD_ACCUM: "gradient_accumulation_steps",
        Role.RECOMPUTE: "gradient_checkpointing",
        Role.SHARDING: "zero_stage",
        Role.WORKERS: "num_workers",
        Role.RESUME: "load_dir",
        Role.RESUME_TAG: "load_tag",
    },
    defaults={
        **COMMON_DEFAULTS,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_stage": 0,
        "offload_optimizer": "none",
        "offload_param": "none",
        "gradient_checkpointing": False,
        "num_workers": -1,
        "load_dir": "",
        "load_tag": "",
    },
    render_args=_args,
    render_env=lambda _knobs: (),
    render_config=_config,
    global_batch_fixed=False,
    invariant=(
        "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x GPUs"
    ),
    resume_note="--load_dir CHECKPOINT_ROOT [--ckpt_tag TAG] (the `latest` file names the tag)",
    recognise_flags={
        "--gradient_checkpointing": "gradient_checkpointing",
        "--num_workers": "num_workers",
        "--load_dir": "load_dir",
        "--ckpt_tag": "load_tag",
    },
)
