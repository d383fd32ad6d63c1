"""The Hugging Face dialect: the real `transformers.Trainer` on CPU over gloo, as run_clm runs it.

The emulator's HF flags (read by `emulation.dialects`) become `TrainingArguments`; what they
leave unread is offered to the Trainer where it takes that argument for real
(`trainer_flags`), and the rest is noted once and ignored, as the emulator does. Everything
the daemon reads is the Trainer's own: its tqdm bar and loss dicts, its `***** Running
training *****` and resume lines (log level info on each node's first rank, as the example
scripts set it), its `checkpoint-N/` directories (model.safetensors, optimizer.pt,
scheduler.pt, rng_state_R.pth, trainer_state.json with `log_history`) and its real resume.
The CUDA OOM is injected from a callback that arms `realtrain.injection` on the model and
optimizer the Trainer built, so the traceback runs through transformers/trainer.py and
accelerate.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from emulation.checkpoints import ResumePoint
from emulation.dialects import LaunchError
from emulation.model import Recompute
from emulation.runner import Console
from emulation.settings import Settings
from torch.utils.data import Dataset, get_worker_info
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from realtrain.data import (
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_LAYERS,
    TINY_SEQ,
    TINY_VOCAB,
    SyntheticTokens,
    WorkerBallast,
)
from realtrain.distributed import RankEnv
from realtrain.injection import Injection, arm

EXIT_USAGE = 2
DATA_SEED = 1234
TRAIN_SAMPLES = 1024
# The tiny model learns at rates a 1.3B one never would; a short warm-up, then cosine decay.
DEFAULTS: dict[str, Any] = {
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "lr_scheduler_type": "cosine",
    "logging_steps": 1,
}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """transformers' GPT-2 in the tiny shape, the same random weights on every rank (DDP
    checks they agree), ~140k parameters: the Trainer's model, with its own frames."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=TINY_VOCAB,
        n_positions=TINY_SEQ,
        n_embd=TINY_HIDDEN,
        n_layer=TINY_LAYERS,
        n_head=TINY_HEADS,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        # No dropout: a resumed run then repeats the uninterrupted run's losses exactly.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    # GPT-2's class name names no loss; said outright, transformers does not warn at each rank.
    model.loss_type = "ForCausalLM"
    return model


_FLAG = re.compile(r"(--[A-Za-z0-9_-]+)(?:[ =](.*))?", re.DOTALL)


# Flags the emulator leaves unread that the real Trainer takes as they are on CPU. The others
# are noted and ignored: `--bf16`/`--fp16` ask for a GPU's mixed precision, `--deepspeed` for a
# package this run does not have, a script's own flags mean nothing to the Trainer. (`--optim`
# is the emulator's: an 8-bit choice shrinks the modelled moments; the real run keeps AdamW.)
_TRAINER_FLAGS: dict[str, Callable[[str], Any]] = {
    "--logging_steps": int,
    "--seed": int,
    "--learning_rate": float,
    "--warmup_steps": int,
    "--weight_decay": float,
    "--max_grad_norm": float,
    "--lr_scheduler_type": str,
    "--save_total_limit": int,
}


@dataclass(frozen=True)
class TrainerFlags:
    """What the real Trainer takes of the flags the emulator left unread, and what is left."""

    arguments: Mapping[str, Any]
    unused: tuple[str, ...]


def trainer_flags(ignored: Sequence[str]) -> TrainerFlags:
    """Split the emulator's ignored launch words (`--flag value`, `--flag=value`, `word`).

    Raises LaunchError on a value the Trainer would refuse to parse.
    """
    arguments: dict[str, Any] = {}
    unused: list[str] = []
    for word in ignored:
        match = _FLAG.fullmatch(word)
        convert = _TRAINER_FLAGS.get(match[1]) if match else None
        if match is None or convert is None or match[2] is None:
            unused.append(word)
            continue
        try:
            arguments[match[1].removeprefix("--")] = convert(match[2])
        except ValueError:
            raise LaunchError(f"{match[1]}: cannot read {match[2]!r}") from None
    return TrainerFlags(arguments, tuple(unused))


def training_arguments(
    settings: Settings, world_size: int, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """The emulator's HF knobs as the real `TrainingArguments`' keywords, on CPU over gloo.

    Only keywords: building TrainingArguments sets up accelerate's state, which needs the
    gloo group up (the runner made it with the emulator's NCCL timeout, which accelerate
    would not pass on CPU; `ddp_timeout` says the same for the record).
    """
    saving = bool(settings.output_dir and settings.save_every)
    evaluating = settings.eval_every is not None
    return {
        **DEFAULTS,
        **extra,
        "output_dir": settings.output_dir,
        "use_cpu": True,
        "ddp_backend": "gloo",
        "ddp_timeout": max(1, math.ceil(settings.nccl_timeout_seconds)),
        "report_to": [],
        "disable_tqdm": False,
        "log_level": "info",
        "log_level_replica": "warning",
        "max_steps": settings.max_steps,
        "per_device_train_batch_size": settings.micro_batch,
        "gradient_accumulation_steps": settings.train_config(world_size).grad_accum,
        "activation_checkpointing": settings.recompute is Recompute.FULL,
        # The Trainer would look for unused parameters each step (it warns of the cost);
        # a GPT-2 has none, and checkpointed activations need the search off.
        "ddp_find_unused_parameters": False,
        "dataloader_num_workers": settings.dataloader_workers,
        "save_strategy": "steps" if saving else "no",
        "save_steps": settings.save_every or 1,
        "eval_strategy": "steps" if evaluating else "no",
        "eval_steps": settings.eval_every,
        "per_device_eval_batch_size": settings.eval_batch,
        "eval_accumulation_steps": settings.eval_accumulation_steps,
    }


class WorkerHeldTokens(Dataset[dict[str, torch.Tensor]]):
    """The token data set, whose every dataloader worker holds `ballast` for its life.

    The Trainer builds its own DataLoader (no `worker_init_fn` of ours), so the first item a
    worker reads makes it take its memory, as a worker's caches and prefetch queues would.
    """

    def __init__(self, tokens: SyntheticTokens, ballast: WorkerBallast) -> None:
        self.tokens = tokens
        self.ballast = ballast

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        worker = get_worker_info()
        if worker is not None and not self.ballast.held:
            self.ballast(worker.id)
        return self.tokens[index]


class PacedInjection(TrainerCallback):
    """Arms the injection on what the Trainer built, paces steps, and tells the hooks the step.

    `on_train_begin` comes after the Trainer has wrapped the model, made the optimizer and
    loaded a checkpoint; `on_step_begin` comes before a step's first micro-batch, and the
    step's evaluation runs before the next one, so `step` is the 1-based step being run.
    """

    def __init__(self, injection: Injection | None, rank: int, step_seconds: float) -> None:
        self.injection = injection
        self.rank = rank
        self.step_seconds = step_seconds
        self.step = 0

    def current_step(self) -> int:
        return self.step

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model = kwargs["model"]
        # accelerate's AcceleratedOptimizer wraps the torch optimizer, whose step hooks fire.
        optimizer = getattr(kwargs["optimizer"], "optimizer", kwargs["optimizer"])
        arm(model, optimizer, self.injection, self.rank, self.current_step)

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.step = state.global_step + 1
        if self.step_seconds > 0:
            time.sleep(self.step_seconds)


def run_hf(
    settings: Settings,
    rank: RankEnv,
    injection: Injection | None,
    console: Console,
    *,
    resume: ResumePoint | None,
    worker_mib: int,
    ignored: Sequence[str] = (),
) -> int:
    """Train with the real Trainer from `resume` (or from scratch) to `--max_steps`.

    Returns 0 (or 2 for a flag value the Trainer would refuse); raises what killed the run.
    """
    try:
        flags = trainer_flags(ignored)
    except LaunchError as error:
        console.error(f"[real-train] error: {error}")
        return EXIT_USAGE
    if flags.unused and rank.rank == 0:
        console.line(
            "[real-train] note: ignoring what the real run does not use: " + " ".join(flags.unused)
        )
    # accelerate sets torch's threads to cores / local ranks unless OMP_NUM_THREADS is set;
    # the runner's one thread per rank is what a 2-core machine with many ranks can afford.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = TrainingArguments(**training_arguments(settings, rank.world_size, flags.arguments))
    ballast = WorkerBallast(worker_mib)
    evaluating = settings.eval_every is not None
    clock = PacedInjection(injection, rank.rank, settings.step_seconds)
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=WorkerHeldTokens(SyntheticTokens(TRAIN_SAMPLES, seed=DATA_SEED), ballast),
        eval_dataset=(
            SyntheticTokens(settings.eval_samples, seed=DATA_SEED + 1) if evaluating else None
        ),
        callbacks=[clock],
    )
    result = trainer.train(resume_from_checkpoint=str(resume.path) if resume else None)
    if rank.rank == 0:
        console.line(f"[real-train] training completed at step {result.global_step}")
    return 0
