"""One rank of the real run: read the launch as the emulator does, join the group, dispatch.

The launch (flags, environment, scenario presets, node fixtures) is read by the emulator's
own modules, so both programs take the same command and the memory model gives the same
verdict; what differs is that this one really trains.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata

import torch
import torch.distributed as dist
from emulation.checkpoints import CheckpointError, ResumePoint, find_resume_point
from emulation.dialects import LaunchError, parse_launch
from emulation.runner import Console, resolve_settings
from emulation.settings import Dialect, Settings
from emulation.topology import DEFAULT_STATE_DIR, TopologyError, placement_from_env, read_fixture

from realtrain.data import worker_mib_from_env
from realtrain.distributed import init_process_group, rank_env
from realtrain.injection import linger_after_death, plan_injection
from realtrain.torchrun import run_torchrun

EXIT_USAGE = 2
# transformers' version from its metadata: only the hf dialect imports it (seconds per rank).
TRANSFORMERS_VERSION = metadata.version("transformers")
BANNER = (
    f"[real-train] REAL torch {torch.__version__} + transformers {TRANSFORMERS_VERSION} "
    "gloo run; the CUDA OOM is INJECTED (no GPU): memory figures are modelled"
)
REAL_DIALECTS = (Dialect.TORCHRUN, Dialect.HF)
# The dead rank stays up longer than gloo's timeout, so its peers time out first: by a share
# of the timeout, at least LINGER_MARGIN_MIN_S, plus a step (a peer may enter the collective
# a step later than the dead rank died).
LINGER_MARGIN_SHARE = 0.25
LINGER_MARGIN_MIN_S = 2.0


class RealTrainError(ValueError):
    """A launch the real run refuses (its message is printed, exit 2)."""


def _resume_point(settings: Settings) -> ResumePoint | None:
    if not settings.resume_from:
        return None
    return find_resume_point(
        settings.dialect,
        settings.resume_from,
        output_dir=settings.output_dir,
        tag=settings.resume_tag,
    )


def run(argv: Sequence[str], env: Mapping[str, str], console: Console) -> int:
    """One rank; returns the exit code, or raises the (injected or real) error that killed it."""
    console.line(BANNER)
    hostname = socket.gethostname()
    try:
        parsed = parse_launch(argv, env)
        if parsed.dialect not in REAL_DIALECTS:
            raise RealTrainError(
                f"the {parsed.dialect} dialect has no real run; use emulated-train for it"
            )
        settings = resolve_settings(parsed)
        placement = placement_from_env(env, hostname)
        rank = rank_env(env, hostname)
        worker_mib = worker_mib_from_env(env)
        state_dir = env.get("DEVCLUSTER_STATE") or DEFAULT_STATE_DIR
        fixtures = {node: read_fixture(state_dir, node) for node in set(placement.nodes)}
    except (LaunchError, TopologyError, ValueError) as error:
        console.error(f"[real-train] error: {error}")
        return EXIT_USAGE
    # The hf dialect notes what neither the emulator's flags nor the Trainer take itself.
    if parsed.ignored and rank.rank == 0 and parsed.dialect is not Dialect.HF:
        console.line(
            "[real-train] note: ignoring what the real run does not use: "
            + " ".join(parsed.ignored)
        )
    try:
        resume = _resume_point(settings)
    except CheckpointError as error:
        console.error(f"[rank{rank.rank}]: {error}")
        return 1

    torch.set_num_threads(1)
    init_process_group(rank, settings.nccl_timeout_seconds)
    injection = plan_injection(
        settings, placement, fixtures, start_step=resume.step if resume else 0
    )
    if injection is not None and injection.rank == rank.rank:
        timeout = settings.nccl_timeout_seconds
        margin = max(LINGER_MARGIN_MIN_S, LINGER_MARGIN_SHARE * timeout) + settings.step_seconds
        linger_after_death(timeout + margin)
    if settings.dialect is Dialect.TORCHRUN:
        code = run_torchrun(
            settings, rank, injection, console, resume=resume, worker_mib=worker_mib
        )
    else:
        from realtrain.hf import run_hf  # noqa: PLC0415 (transformers: only this dialect's cost)

        code = run_hf(
            settings,
            rank,
            injection,
            console,
            resume=resume,
            worker_mib=worker_mib,
            ignored=parsed.ignored,
        )
    dist.destroy_process_group()
    return code


def main() -> int:
    return run(sys.argv[1:], os.environ, Console(sys.stdout, sys.stderr))
