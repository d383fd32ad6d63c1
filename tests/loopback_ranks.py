"""Ranks of the real training program started as local processes on loopback, as torchrun
under srun would start them (one rank per modelled node), for the real-run unit tests."""

from __future__ import annotations

import os
import socket

# What the host's own environment must not lend a rank: its launch comes from these tests.
_INHERITED_PREFIXES = ("SLURM", "EMULATION_", "PYTORCH_", "REALTRAIN_", "MASTER_")
_INHERITED_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def loopback_rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """torchrun's variables on loopback; the node list places rank r on modelled node gpu-0r+1
    (so the memory model and the node fixtures see a `world`-node job)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_INHERITED_PREFIXES) and key not in _INHERITED_NAMES
    }
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SLURMD_NODENAME=f"gpu-0{rank + 1}",
        SLURM_JOB_NODELIST=f"gpu-[01-0{world}]",
        DEVCLUSTER_STATE="/nonexistent-devcluster-state",
    )
    env.update(extra)
    return env
