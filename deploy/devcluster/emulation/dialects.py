"""Reading a launch command the way each framework would: its real flags and environment.

Each dialect maps its own spelling of a knob onto the same Settings field (HF Trainer's
`--per_device_train_batch_size`, Megatron's `--micro-batch-size`, DeepSpeed's
`train_micro_batch_size_per_gpu`, plain torchrun's `MICRO_BATCH`), so a fix that the planner
writes in the dialect's own words changes the modelled run. Flags nobody models are
reported back and otherwise ignored, as real launchers pass many.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulation.model import Recompute, parse_allocator_conf
from emulation.settings import Dialect

Overrides = dict[str, Any]
Handler = Callable[[str], Overrides]

_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


class LaunchError(ValueError):
    """A launch command the emulated framework would refuse too (bad value, unreadable config)."""


def _int(field_name: str, *, minimum: int = 1) -> Handler:
    def handle(value: str) -> Overrides:
        try:
            number = int(value)
        except ValueError:
            raise LaunchError(f"{field_name}: expected an integer, got {value!r}") from None
        if number < minimum:
            raise LaunchError(f"{field_name}: expected at least {minimum}, got {number}")
        return {field_name: number}

    return handle


def _float(field_name: str) -> Handler:
    def handle(value: str) -> Overrides:
        try:
            number = float(value)
        except ValueError:
            raise LaunchError(f"{field_name}: expected a number, got {value!r}") from None
        if number < 0:
            raise LaunchError(f"{field_name}: expected a non-negative number, got {number}")
        return {field_name: number}

    return handle


def _text(field_name: str) -> Handler:
    return lambda value: {field_name: value}


def _flag_bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise LaunchError(f"expected true or false, got {value!r}")


def _gradient_checkpointing(value: str) -> Overrides:
    return {"recompute": Recompute.FULL if _flag_bool(value) else Recompute.NONE}


def _distributed_optimizer(value: str) -> Overrides:
    return {"zero_stage": 1} if _flag_bool(value) else {}


def _recompute_granularity(value: str) -> Overrides:
    try:
        return {"recompute": Recompute(value)}
    except ValueError:
        raise LaunchError(f"recompute: expected full or selective, got {value!r}") from None


def _eval_strategy(value: str) -> Overrides:
    return {"eval_every": None} if value == "no" else {}


def _hf_optim(value: str) -> Overrides:
    """`--optim adamw_bnb_8bit` and the other 8-bit choices shrink Adam's moments."""
    return {"optimizer_8bit": "8bit" in value}


def _load_dir(value: str) -> Overrides:
    return {"resume_from": value}


def _deepspeed_config(value: str) -> Overrides:
    """The knobs a DeepSpeed JSON config holds; "auto" leaves the Trainer's flag in charge."""
    try:
        config = json.loads(Path(value).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LaunchError(f"--deepspeed: cannot read config {value!r}: {error}") from None
    if not isinstance(config, dict):
        raise LaunchError(f"--deepspeed: config {value!r} is not a JSON object")
    overrides: Overrides = {}
    for key, field_name in (
        ("train_micro_batch_size_per_gpu", "micro_batch"),
        ("gradient_accumulation_steps", "grad_accum"),
        ("train_batch_size", "global_batch"),
    ):
        setting = config.get(key, "auto")
        if setting == "auto":
            continue
        if not isinstance(setting, int) or isinstance(setting, bool) or setting < 1:
            raise LaunchError(f"--deepspeed: {key} must be a positive integer or 'auto'")
        overrides[field_name] = setting
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise LaunchError("--deepspeed: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise LaunchError(f"--deepspeed: zero_optimization.stage must be 0..3, got {stage!r}")
    overrides["zero_stage"] = stage
    offload = zero.get("offload_optimizer", {})
    if isinstance(offload, dict) and offload.get("device", "none") in ("cpu", "nvme"):
        overrides["offload_optimizer"] = True
    return overrides


_HF_FLAGS: dict[str, Handler] = {
    "--per_device_train_batch_size": _int("micro_batch"),
    "--gradient_accumulation_steps": _int("grad_accum"),
    "--gradient_checkpointing": _gradient_checkpointing,
    "--per_device_eval_batch_size": _int("eval_batch"),
    "--eval_accumulation_steps": _int("eval_accumulation_steps"),
    "--dataloader_num_workers": _int("dataloader_workers", minimum=0),
    "--resume_from_checkpoint": _text("resume_from"),
    "--output_dir": _text("output_dir"),
    "--max_steps": _int("max_steps"),
    "--eval_steps": _int("eval_every"),
    "--eval_strategy": _eval_strategy,
    "--evaluation_strategy": _eval_strategy,
    "--save_steps": _int("save_every"),
    "--max_eval_samples": _int("eval_samples"),
    "--block_size": _int("seq_length"),
    "--max_seq_length": _int("seq_length"),
    "--generation_max_length": _int("generate_tokens", minimum=0),
    "--optim": _hf_optim,
}
_HF_BOOLEANS = frozenset({"--gradient_checkpointing"})

_MEGATRON_FLAGS: dict[str, Handler] = {
    "--micro-batch-size": _int("micro_batch"),
    "--global-batch-size": _int("global_batch"),
    "--recompute-granularity": _recompute_granularity,
    "--recompute-method": lambda value: {},
    "--recompute-num-layers": _int("recompute_num_layers"),
    "--use-distributed-optimizer": _distributed_optimizer,
    "--tensor-model-parallel-size": _int("tensor_parallel"),
    "--pipeline-model-parallel-size": _int("pipeline_parallel"),
    "--num-layers": _int("num_layers"),
    "--hidden-size": _int("hidden_size"),
    "--num-attention-heads": _int("num_heads"),
    "--seq-length": _int("seq_length"),
    "--vocab-size": _int("vocab_size"),
    "--train-iters": _int("max_steps"),
    "--save": _text("output_dir"),
    "--load": _load_dir,
    "--save-interval": _int("save_every"),
    "--eval-interval": _int("eval_every"),
    "--num-workers": _int("dataloader_workers", minimum=0),
}
_MEGATRON_BOOLEANS = frozenset({"--use-distributed-optimizer"})

_DEEPSPEED_FLAGS: dict[str, Handler] = {
    **_HF_FLAGS,
    "--deepspeed": _deepspeed_config,
    "--deepspeed_config": _deepspeed_config,
    "--save_dir": _text("output_dir"),
    "--load_dir": _load_dir,
    "--ckpt_tag": _text("resume_tag"),
    "--load_tag": _text("resume_tag"),
    "--save_interval": _int("save_every"),
    "--train_iters": _int("max_steps"),
    "--num_workers": _int("dataloader_workers", minimum=0),
}

# The emulation's own knobs, accepted in every dialect; EMULATION_* env spells them too.
EMULATION_FLAGS: dict[str, Handler] = {
    "--scenario": _text("scenario"),
    "--step-seconds": _float("step_seconds"),
    "--save-seconds": _float("save_seconds"),
    "--nccl-timeout-seconds": _float("nccl_timeout_seconds"),
    "--oom-rank": _int("oom_rank", minimum=0),
    "--card-gib": _float("card_gib"),
    "--host-ram-gib": _float("host_ram_gib"),
    "--longest-batch-step": _int("longest_batch_step"),
    "--longest-batch-factor": _float("longest_batch_factor"),
}
EMULATION_ENV: dict[str, str] = {
    "EMULATION_STEP_SECONDS": "--step-seconds",
    "EMULATION_NCCL_TIMEOUT_SECONDS": "--nccl-timeout-seconds",
    "EMULATION_OOM_RANK": "--oom-rank",
    "EMULATION_CARD_GIB": "--card-gib",
    "EMULATION_HOST_RAM_GIB": "--host-ram-gib",
}

# Plain torchrun scripts read their knobs from the environment (README.md lists them).
TORCHRUN_ENV: dict[str, Handler] = {
    "MICRO_BATCH": _int("micro_batch"),
    "GRAD_ACCUM": _int("grad_accum"),
    "RECOMPUTE": _recompute_granularity,
    "ZERO_STAGE": _int("zero_stage", minimum=0),
    "OFFLOAD_OPTIMIZER": lambda value: {"offload_optimizer": _flag_bool(value)},
    "EVAL_BATCH": _int("eval_batch"),
    "EVAL_ACCUM": _int("eval_accumulation_steps"),
    "EVAL_EVERY": _int("eval_every"),
    "EVAL_SAMPLES": _int("eval_samples"),
    "NUM_WORKERS": _int("dataloader_workers", minimum=0),
    "MAX_STEPS": _int("max_steps"),
    "SEQ_LEN": _int("seq_length"),
    "CKPT_DIR": _text("output_dir"),
    "SAVE_EVERY": _int("save_every"),
    "RESUME_FROM": _text("resume_from"),
}

_DIALECT_FLAGS: dict[Dialect, tuple[dict[str, Handler], frozenset[str]]] = {
    Dialect.HF: (_HF_FLAGS, _HF_BOOLEANS),
    Dialect.MEGATRON: (_MEGATRON_FLAGS, _MEGATRON_BOOLEANS),
    Dialect.DEEPSPEED: (_DEEPSPEED_FLAGS, _HF_BOOLEANS),
    Dialect.TORCHRUN: ({}, frozenset()),
}


@dataclass(frozen=True)
class ParsedLaunch:
    """What a launch command asks for, in the order it must be applied, and what was ignored."""

    dialect: Dialect
    scenario: str | None
    overrides: Overrides
    ignored: tuple[str, ...]


def _split_dialect(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str | None, list[str]]:
    args = list(argv)
    if args and args[0] == "--dialect":
        if len(args) < 2:
            raise LaunchError("--dialect needs a value: hf, megatron, deepspeed or torchrun")
        return args[1], args[2:]
    if args and args[0].startswith("--dialect="):
        return args[0].partition("=")[2], args[1:]
    return env.get("EMULATION_DIALECT"), args


def infer_dialect(args: Sequence[str]) -> Dialect:
    """DeepSpeed if given a DeepSpeed config, else whose flag spelling appears, else torchrun."""
    flags = {arg.partition("=")[0] for arg in args if arg.startswith("--")}
    if flags & {"--deepspeed", "--deepspeed_config"}:
        return Dialect.DEEPSPEED
    if flags & _HF_FLAGS.keys():
        return Dialect.HF
    if flags & _MEGATRON_FLAGS.keys():
        return Dialect.MEGATRON
    return Dialect.TORCHRUN


def parse_launch(argv: Sequence[str], env: Mapping[str, str]) -> ParsedLaunch:
    """Read argv and environment; later sources win: env knobs, then flags in argv order."""
    dialect_name, args = _split_dialect(argv, env)
    if dialect_name is None:
        dialect = infer_dialect(args)
    else:
        try:
            dialect = Dialect(dialect_name)
        except ValueError:
            known = ", ".join(d.value for d in Dialect)
            raise LaunchError(f"unknown dialect {dialect_name!r}; known: {known}") from None
    flags, booleans = _DIALECT_FLAGS[dialect]
    handlers = {**flags, **EMULATION_FLAGS}
    overrides: Overrides = {}
    ignored: list[str] = []
    scenario = env.get("EMULATION_SCENARIO") or None

    for name, flag in EMULATION_ENV.items():
        if name in env:
            overrides.update(EMULATION_FLAGS[flag](env[name]))
    if dialect is Dialect.TORCHRUN:
        for name, handler in TORCHRUN_ENV.items():
            if name in env:
                overrides.update(handler(env[name]))
    alloc_text = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF")
    if alloc_text:
        try:
            allocator, unknown_keys = parse_allocator_conf(alloc_text)
        except ValueError as error:
            raise LaunchError(f"PYTORCH_ALLOC_CONF: {error}") from None
        overrides["allocator"] = allocator
        ignored.extend(f"allocator option {key}" for key in unknown_keys)

    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if not arg.startswith("--"):
            ignored.append(arg)
            continue
        name, has_inline, inline = arg.partition("=")
        flag_handler = handlers.get(name)
        value: str | None = inline if has_inline else None
        takes_next = index < len(args) and not args[index].startswith("--")
        if value is None and takes_next:
            next_arg = args[index]
            is_boolean = name in booleans
            if not is_boolean or next_arg.lower() in _TRUE | _FALSE:
                value = next_arg
                index += 1
        if flag_handler is None:
            ignored.append(arg if value is None or has_inline else f"{arg} {value}")
            continue
        if value is None:
            if name not in booleans:
                raise LaunchError(f"{name} needs a value")
            value = "true"
        if name == "--scenario":
            scenario = value
            continue
        try:
            overrides.update(flag_handler(value))
        except LaunchError as error:
            raise LaunchError(f"{name}: {error}") from None
    return ParsedLaunch(dialect, scenario, overrides, tuple(ignored))
