"""Who this rank is and where its rendezvous is, from srun's or torchrun's environment.

srun starts every rank itself (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID); torchrun sets
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and wins where it did. The rendezvous
is the first node of the step, on a port derived from the job id: jobs of several test
sessions share the nodes, and each node is a network namespace with its own address.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from emulation.topology import TopologyError, expand_nodelist, placement_from_env
from torch._C._distributed_c10d import TCPStore

# Above the well-known and registered-by-habit ports (Slurm's 6817-6819, 29500 torchrun's
# default) and below Linux's ephemeral range (32768+), so a rendezvous never collides with
# a client socket.
PORT_BASE = 10000
PORT_SPAN = 20000
LOOPBACK = "127.0.0.1"
RENDEZVOUS_TIMEOUT_S = 300
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
DISCARD_PORT = 9


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    node: str


def master_port_for(job_id: int) -> int:
    """One port per job, the same on every rank of it without talking."""
    return PORT_BASE + job_id % PORT_SPAN


def rank_env(env: Mapping[str, str], hostname: str | None = None) -> RankEnv:
    """Rank, world and rendezvous; MASTER_ADDR/MASTER_PORT given (torchrun, tests) win."""
    placement = placement_from_env(env, hostname or socket.gethostname())
    return RankEnv(
        rank=placement.rank,
        world_size=placement.world_size,
        local_rank=placement.local_rank,
        master_addr=_master_addr(env),
        master_port=_master_port(env),
        node=placement.node,
    )


def _master_addr(env: Mapping[str, str]) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    return expand_nodelist(nodelist)[0] if nodelist else LOOPBACK


def _master_port(env: Mapping[str, str]) -> int:
    for name in ("MASTER_PORT", "SLURM_JOB_ID"):
        value = env.get(name)
        if not value:
            continue
        try:
            number = int(value)
        except ValueError:
            raise TopologyError(f"{name}={value!r} is not an integer") from None
        return number if name == "MASTER_PORT" else master_port_for(number)
    return master_port_for(0)


def export_rank_env(rank: RankEnv) -> None:
    """What torch's env:// rendezvous and the HF Trainer read from the environment."""
    os.environ.update(
        RANK=str(rank.rank),
        WORLD_SIZE=str(rank.world_size),
        LOCAL_RANK=str(rank.local_rank),
        MASTER_ADDR=rank.master_addr,
        MASTER_PORT=str(rank.master_port),
    )


def _interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:  # an interface without an IPv4 address
            return None
    return socket.inet_ntoa(answer[20:24])


def interface_towards(address: str) -> str | None:
    """The network interface this host reaches `address` through, or None if none has it.

    Gloo advertises the address its host name resolves to; on the devcluster every node
    shares the machine's host name, which resolves to 127.0.0.1, so peers on other nodes
    would be told to connect to their own loopback.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, DISCARD_PORT))  # UDP: picks the route, sends nothing
        local = probe.getsockname()[0]
    return next(
        (name for _, name in socket.if_nameindex() if _interface_address(name) == local), None
    )


def init_process_group(rank: RankEnv, timeout_s: float) -> None:
    """The gloo group; `timeout_s` bounds every collective, as NCCL's watchdog timeout does.

    The rendezvous waits longer than that (RENDEZVOUS_TIMEOUT_S), as torchrun's does: ranks
    importing torch on a loaded node arrive seconds apart, which is no hang.
    """
    export_rank_env(rank)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_towards(socket.gethostbyname(rank.master_addr))
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    store = TCPStore(
        rank.master_addr,
        rank.master_port,
        rank.world_size,
        is_master=rank.rank == 0,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
        wait_for_workers=True,
    )
    dist.init_process_group(
        backend="gloo",
        store=store,
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
