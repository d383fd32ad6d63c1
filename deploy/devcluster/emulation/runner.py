"""The emulated run itself: the only module here with side effects (clock, files, signals).

Every rank works out the whole run's fate from the same inputs (the launch command, the
memory model, every node's fixture), so ranks agree without talking: the rank that runs
out of memory prints the traceback and exits 1, the others wait in the collective it never
joins until NCCL's watchdog takes them down, as on a real cluster.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from emulation.checkpoints import (
    CheckpointError,
    ResumePoint,
    find_resume_point,
    write_checkpoint,
)
from emulation.dialects import LaunchError, ParsedLaunch, parse_launch
from emulation.messages import (
    EMULATION_BANNER,
    StepReport,
    deepspeed_line,
    hf_log_line,
    ignored_note,
    megatron_line,
    oom_traceback,
    torchrun_line,
    tqdm_line,
    watchdog_lines,
)
from emulation.model import (
    OomEvent,
    Phase,
    TrainConfig,
    host_ram_exceeded,
    params_on_rank,
    simulate,
)
from emulation.settings import Dialect, Settings, apply_scenario
from emulation.topology import (
    DEFAULT_STATE_DIR,
    NodeFixture,
    Placement,
    TopologyError,
    placement_from_env,
    read_fixture,
)

EXIT_USAGE = 2
PEAK_LR = 3e-4
WARMUP_STEPS = 4


@dataclass(frozen=True)
class Failure:
    """The run's first death: which rank, at which step, and (unless host RAM) its OOM."""

    rank: int
    step: int
    oom: OomEvent | None
    cotenant_pid: int | None


def resolve_settings(parsed: ParsedLaunch) -> Settings:
    """Defaults, then the scenario preset, then what the launch command says."""
    settings = Settings(dialect=parsed.dialect)
    if parsed.scenario:
        settings = apply_scenario(settings, parsed.scenario)
    return replace(settings, **parsed.overrides)


def find_failure(
    config: TrainConfig,
    settings: Settings,
    placement: Placement,
    fixtures: Mapping[str, NodeFixture],
    start_step: int,
) -> Failure | None:
    """The earliest death over all ranks; a rank on a sick node goes first, then `oom_rank`."""
    oom_rank = placement.world_size - 1 if settings.oom_rank is None else settings.oom_rank
    oom_rank = min(oom_rank, placement.world_size - 1)
    if host_ram_exceeded(config, settings.host_ram(), placement.ranks_per_node):
        return Failure(oom_rank, start_step + 1, None, None)
    outcomes: dict[str, tuple[OomEvent | None, NodeFixture]] = {}
    best: tuple[tuple[int, int, int, int], Failure] | None = None
    for rank in range(placement.world_size):
        node = placement.node_of(rank)
        if node not in outcomes:
            fixture = fixtures.get(node, NodeFixture())
            card = fixture.card(settings.card_gib)
            outcomes[node] = (simulate(config, card, start_step=start_step).oom, fixture)
        oom, fixture = outcomes[node]
        if oom is None:
            continue
        sick = fixture != NodeFixture()
        key = (oom.step, 0 if sick else 1, 0 if rank == oom_rank else 1, rank)
        if best is None or key < best[0]:
            best = (key, Failure(rank, oom.step, oom, fixture.cotenant_pid))
    return None if best is None else best[1]


class Console:
    """Line output that reaches the job's log at once, as unbuffered framework logs do."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def error(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def redraw(self, text: str) -> None:
        self.err.write("\r" + text)
        self.err.flush()


def _loss(step: int) -> float:
    return 2.0 + 8.0 * math.exp(-step / 6.0)


def _learning_rate(step: int, max_steps: int) -> float:
    if step <= WARMUP_STEPS:
        return PEAK_LR * step / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, max_steps - WARMUP_STEPS)
    return PEAK_LR * 0.5 * (1 + math.cos(math.pi * progress))


def _logs_progress(dialect: Dialect, placement: Placement) -> bool:
    """Megatron prints from the last rank, the others from rank 0."""
    if dialect is Dialect.MEGATRON:
        return placement.rank == placement.world_size - 1
    return placement.rank == 0


def _print_progress(console: Console, settings: Settings, report: StepReport) -> None:
    now = time.time()
    if settings.dialect is Dialect.HF:
        console.redraw(tqdm_line(report))
        console.line("")
        console.line(hf_log_line(report, epoch=report.step / settings.max_steps))
    elif settings.dialect is Dialect.MEGATRON:
        console.line(megatron_line(report, now))
    elif settings.dialect is Dialect.DEEPSPEED:
        console.line(deepspeed_line(report, now))
    else:
        console.line(torchrun_line(report))


def _print_resumed(console: Console, settings: Settings, point: ResumePoint) -> None:
    if settings.dialect is Dialect.HF:
        console.line("  Continuing training from checkpoint, will skip to saved global_step")
        console.line(f"  Continuing training from global step {point.step}")
    elif settings.dialect is Dialect.MEGATRON:
        console.line(
            f" successfully loaded checkpoint from {point.path.parent} "
            f"[ t 1/{settings.tensor_parallel}, p 1/{settings.pipeline_parallel} ] "
            f"at iteration {point.step}"
        )
    elif settings.dialect is Dialect.DEEPSPEED:
        console.line(
            f"[INFO] [torch_checkpoint_engine.py:27:load] [Torch] Loading checkpoint from "
            f"{point.path / 'mp_rank_00_model_states.pt'}..."
        )
        console.line(f"[Rank 0] resumed from {point.path.name} at step {point.step}")
    else:
        console.line(f"resumed from checkpoint {point.path} at step {point.step}")


def _print_saved(console: Console, settings: Settings, path: Path, step: int) -> None:
    if settings.dialect is Dialect.HF:
        console.line(f"Saving model checkpoint to {path}")
    elif settings.dialect is Dialect.MEGATRON:
        console.line(
            f"  successfully saved checkpoint from iteration {step:7d} to {path.parent} "
            f"[ t 1/{settings.tensor_parallel}, p 1/{settings.pipeline_parallel} ]"
        )
    elif settings.dialect is Dialect.DEEPSPEED:
        console.line(
            f"[INFO] [torch_checkpoint_engine.py:33:commit] [Torch] Checkpoint {path.name} "
            "is ready now!"
        )
    else:
        console.line(f"saved checkpoint {path} at step {step}")


def _hang_then_abort(
    console: Console, settings: Settings, placement: Placement, config: TrainConfig, step: int
) -> None:
    """Wait in the collective the dead rank never joins; NCCL's watchdog ends the process."""
    started = time.monotonic()
    time.sleep(settings.nccl_timeout_seconds)
    ran_ms = int((time.monotonic() - started) * 1000)
    for text in watchdog_lines(
        rank=placement.rank,
        seq_num=2 * step + 1,
        numel=min(params_on_rank(config), 2**31 - 1),
        timeout_ms=int(settings.nccl_timeout_seconds * 1000),
        ran_ms=ran_ms,
        now=time.time(),
    ):
        console.error(text)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def _pause(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def run(argv: Sequence[str], env: Mapping[str, str], console: Console) -> int:
    """One rank of the emulated run; returns the exit code (or does not return, if killed)."""
    console.line(EMULATION_BANNER)
    try:
        parsed = parse_launch(argv, env)
        settings = resolve_settings(parsed)
        placement = placement_from_env(env, socket.gethostname())
        state_dir = env.get("DEVCLUSTER_STATE") or DEFAULT_STATE_DIR
        fixtures = {node: read_fixture(state_dir, node) for node in set(placement.nodes)}
    except (LaunchError, TopologyError, ValueError) as error:
        console.error(f"[emulated-train] error: {error}")
        return EXIT_USAGE
    config = settings.train_config(placement.world_size)
    if parsed.ignored and placement.rank == 0:
        console.line(ignored_note(parsed.ignored))

    start_step = 0
    if settings.resume_from:
        try:
            point = find_resume_point(
                settings.dialect,
                settings.resume_from,
                output_dir=settings.output_dir,
                tag=settings.resume_tag,
            )
        except CheckpointError as error:
            console.error(f"[rank{placement.rank}]: {error}")
            return 1
        if point is not None:
            start_step = point.step
            if placement.rank == 0:
                _print_resumed(console, settings, point)

    failure = find_failure(config, settings, placement, fixtures, start_step)
    started = time.monotonic()
    for step in range(start_step + 1, settings.max_steps + 1):
        step_started = time.monotonic()
        _pause(settings.step_seconds)
        dies_now = failure is not None and failure.step == step
        if failure is not None and dies_now and not _fails_after_training(failure):
            return _die(
                console,
                settings=settings,
                placement=placement,
                config=config,
                failure=failure,
                step=step,
            )
        if _logs_progress(settings.dialect, placement):
            report = StepReport(
                step=step,
                max_steps=settings.max_steps,
                loss=_loss(step),
                learning_rate=_learning_rate(step, settings.max_steps),
                elapsed_s=time.monotonic() - started,
                step_s=max(1e-3, time.monotonic() - step_started),
                global_batch=config.global_batch,
                micro_batch=config.micro_batch,
            )
            _print_progress(console, settings, report)
        if failure is not None and dies_now:
            return _die(
                console,
                settings=settings,
                placement=placement,
                config=config,
                failure=failure,
                step=step,
            )
        save_due = bool(settings.save_every) and step % (settings.save_every or 1) == 0
        if settings.output_dir and save_due and placement.rank == 0:
            path = write_checkpoint(
                settings.dialect,
                Path(settings.output_dir),
                step=step,
                max_steps=settings.max_steps,
                world_size=placement.world_size,
                tensor_parallel=settings.tensor_parallel,
                pipeline_parallel=settings.pipeline_parallel,
                pause=lambda: _pause(settings.save_seconds),
            )
            _print_saved(console, settings, path, step)
    if placement.rank == 0:
        console.line(f"[emulated-train] training completed at step {settings.max_steps}")
    return 0


def _fails_after_training(failure: Failure) -> bool:
    """An eval OOM comes after the step's training part, whose progress line is printed."""
    return failure.oom is not None and failure.oom.phase is Phase.EVAL


def _die(
    console: Console,
    *,
    settings: Settings,
    placement: Placement,
    config: TrainConfig,
    failure: Failure,
    step: int,
) -> int:
    if placement.rank != failure.rank:
        _hang_then_abort(console, settings, placement, config, step)
        return 1
    if failure.oom is None:
        os.kill(os.getpid(), signal.SIGKILL)
        return 137
    for text in oom_traceback(
        settings.dialect,
        failure.oom,
        rank=placement.rank,
        device=placement.local_rank,
        cotenant_pid=failure.cotenant_pid,
    ):
        console.error(text)
    return 1


def main() -> int:
    return run(sys.argv[1:], os.environ, Console(sys.stdout, sys.stderr))
