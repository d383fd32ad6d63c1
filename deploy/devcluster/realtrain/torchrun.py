"""The plain-torch dialect: a hand-written DDP training loop, as `torchrun train.py` runs one,
on a tiny GPT-2 written with torch.nn (`realtrain.model`): its ranks never import transformers.

Knobs come from the environment as the emulator's torchrun dialect reads them (MICRO_BATCH,
GRAD_ACCUM, NUM_WORKERS, MAX_STEPS, CKPT_DIR, SAVE_EVERY, RESUME_FROM, EVAL_*). Checkpoints
are torch.distributed.checkpoint (DCP) directories `CKPT_DIR/step_N/` written by torch
itself: one `__R_0.distcp` per rank, then `.metadata`, which marks the checkpoint complete.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from emulation.checkpoints import ResumePoint, checkpoint_path
from emulation.messages import StepReport, torchrun_line
from emulation.runner import Console
from emulation.settings import Dialect, Settings
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from realtrain.data import StepSampler, SyntheticTokens, WorkerBallast
from realtrain.distributed import RankEnv
from realtrain.injection import Injection, arm
from realtrain.model import TinyGPT, tiny_gpt

PEAK_LR = 3e-3
WARMUP_STEPS = 2
DATA_SEED = 1234
TRAIN_SAMPLES = 1024
# Evaluation is real but small: at most this many batches, and a few generated tokens.
EVAL_BATCHES_MAX = 2
GENERATE_TOKENS_MAX = 4
PROMPT_TOKENS = 8


def learning_rate_factor(step: int, max_steps: int) -> float:
    """Linear warm-up, then cosine decay to zero; a factor of PEAK_LR for LambdaLR."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, max_steps - WARMUP_STEPS)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class _Progress:
    """The step being run, read by the injection's hooks."""

    def __init__(self) -> None:
        self.step = 0

    def current(self) -> int:
        return self.step


@dataclass(frozen=True)
class Trainable:
    """What a checkpoint holds besides the step: the weights, Adam's state, the schedule."""

    model: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def _checkpoint_state(parts: Trainable, step: int) -> dict[str, object]:
    model_state, optimizer_state = get_state_dict(parts.model, parts.optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": parts.scheduler.state_dict(),
        "progress": {"step": torch.tensor(step)},
    }


def save_checkpoint(root: Path, step: int, parts: Trainable) -> Path:
    """A collective: every rank writes its own shard, the coordinator `.metadata` last."""
    path = checkpoint_path(Dialect.TORCHRUN, root, step)
    dcp_save(_checkpoint_state(parts, step), checkpoint_id=path)
    return path


def load_checkpoint(point: ResumePoint, parts: Trainable) -> int:
    """Weights, optimizer (Adam's moments included), schedule and step from a DCP directory."""
    state = _checkpoint_state(parts, 0)
    dcp_load(state, checkpoint_id=point.path)
    set_state_dict(
        parts.model,
        parts.optimizer,
        model_state_dict=state["model"],  # type: ignore[arg-type]
        optim_state_dict=state["optimizer"],  # type: ignore[arg-type]
    )
    parts.scheduler.load_state_dict(state["scheduler"])  # type: ignore[arg-type]
    progress = state["progress"]
    assert isinstance(progress, dict)
    return int(progress["step"])


def _train_loader(settings: Settings, rank: RankEnv, worker_mib: int) -> DataLoader[object]:
    sampler = StepSampler(
        TRAIN_SAMPLES,
        per_rank=settings.micro_batch * settings.grad_accum,
        rank=rank.rank,
        world_size=rank.world_size,
        seed=DATA_SEED,
    )
    workers = settings.dataloader_workers
    return DataLoader(
        SyntheticTokens(TRAIN_SAMPLES, seed=DATA_SEED),
        batch_size=settings.micro_batch,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=WorkerBallast(worker_mib) if workers else None,
    )


def _evaluate(model: TinyGPT, settings: Settings) -> torch.Tensor:
    """Eval loss over a few batches, and a short generate, with the weights in eval mode."""
    data = SyntheticTokens(settings.eval_samples, seed=DATA_SEED + 1)
    batches = min(EVAL_BATCHES_MAX, math.ceil(len(data) / settings.eval_batch))
    total = torch.zeros(())
    model.eval()
    with torch.no_grad():
        for index in range(batches):
            rows = data.tokens[index * settings.eval_batch : (index + 1) * settings.eval_batch]
            mask = torch.ones_like(rows)
            total += model(input_ids=rows, attention_mask=mask, labels=rows).loss
            if settings.generate_tokens:
                model.generate(
                    input_ids=rows[:, :PROMPT_TOKENS],
                    max_new_tokens=min(GENERATE_TOKENS_MAX, settings.generate_tokens),
                )
    model.train()
    return total / batches


def run_torchrun(
    settings: Settings,
    rank: RankEnv,
    injection: Injection | None,
    console: Console,
    *,
    resume: ResumePoint | None,
    worker_mib: int,
) -> int:
    """Train from `resume` (or from scratch) to MAX_STEPS; returns 0, or raises what killed it."""
    model = tiny_gpt()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=PEAK_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda index: learning_rate_factor(index, settings.max_steps)
    )
    parts = Trainable(ddp, optimizer, scheduler)
    start_step = 0
    if resume is not None:
        start_step = load_checkpoint(resume, parts)
        if rank.rank == 0:
            console.line(f"resumed from checkpoint {resume.path} at step {start_step}")
    progress = _Progress()
    arm(model, optimizer, injection, rank.rank, progress.current)
    loader = _train_loader(settings, rank, worker_mib)
    sampler = loader.sampler
    assert isinstance(sampler, StepSampler)
    started = time.monotonic()
    for step in range(start_step + 1, settings.max_steps + 1):
        step_started = time.monotonic()
        progress.step = step
        sampler.step = step
        if settings.step_seconds > 0:
            time.sleep(settings.step_seconds)
        step_loss = torch.zeros(())
        batches = list(enumerate(loader))
        for index, batch in batches:
            last = index == len(batches) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ddp(**batch).loss / len(batches)
                loss.backward()
            step_loss += loss.detach()
        learning_rate = float(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)  # gloo has no AVG
        step_loss /= rank.world_size
        if rank.rank == 0:
            report = StepReport(
                step=step,
                max_steps=settings.max_steps,
                loss=float(step_loss),
                learning_rate=learning_rate,
                elapsed_s=time.monotonic() - started,
                step_s=max(1e-3, time.monotonic() - step_started),
                global_batch=settings.micro_batch * settings.grad_accum * rank.world_size,
                micro_batch=settings.micro_batch,
            )
            console.line(torchrun_line(report))
        if settings.eval_every and step % settings.eval_every == 0:
            eval_loss = _evaluate(model, settings)
            dist.all_reduce(eval_loss)
            eval_loss /= rank.world_size
            if rank.rank == 0:
                console.line(f"eval at step {step} | loss {float(eval_loss):.4f}")
        if settings.output_dir and settings.save_every and step % settings.save_every == 0:
            path = save_checkpoint(Path(settings.output_dir), step, parts)
            if rank.rank == 0:
                console.line(f"saved checkpoint {path} at step {step}")
    dist.barrier()
    if rank.rank == 0:
        console.line(f"[real-train] training completed at step {settings.max_steps}")
    return 0
