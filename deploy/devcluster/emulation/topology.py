"""Where this rank sits (rank, world, node, local GPU) and what each node's card is like.

A node's card comes from the devcluster's node-state fixture, an optional JSON file at
`$DEVCLUSTER_STATE/nodes/<node>/fixture/emulation.json` (default state dir
/var/lib/slurm-medic-devcluster). Its schema, every key optional:

    {"xid": 79,                  # an XID the node's dmesg shows; alone, the card lost
                                 # DEFAULT_XID_LOST_GIB of memory
     "card_bytes_lost": 25769803776,   # bytes the sick card no longer offers
     "cotenant_bytes": 32212254720,    # bytes another process holds on the job's GPU
     "cotenant_pid": 48213}            # that process's pid, named in the OOM message

Every rank reads every node's file, so the healthy ranks know where the run will die and
hang there, as real ranks wait in the collective the dead rank never joins.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from emulation.model import GIB, Card

DEFAULT_STATE_DIR = "/var/lib/slurm-medic-devcluster"
FIXTURE_NAME = "emulation.json"
DEFAULT_XID_LOST_GIB = 24
DEFAULT_COTENANT_PID = 48213


class TopologyError(ValueError):
    """Rank variables or a node fixture that cannot be read as documented."""


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    node: str
    nodes: tuple[str, ...]

    def node_of(self, rank: int) -> str:
        """The node of `rank` under srun's default block distribution."""
        if not self.nodes:
            return self.node
        per_node = max(1, -(-self.world_size // len(self.nodes)))
        return self.nodes[min(rank // per_node, len(self.nodes) - 1)]

    @property
    def ranks_per_node(self) -> int:
        return max(1, -(-self.world_size // max(1, len(self.nodes))))


_RANGE_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str) -> tuple[str, ...]:
    """Expand Slurm's compressed list (`gpu-[01-03,07],login1`) into node names."""
    names: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", text):
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if ranges is None:
            names.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            bounds = _RANGE_ITEM.match(item)
            if bounds is None:
                raise TopologyError(f"cannot read node range {item!r} in {text!r}")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            width = len(low)
            for number in range(int(low), int(high) + 1):
                names.append(f"{prefix}{number:0{width}d}{suffix}")
    return tuple(names)


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise TopologyError(f"{name}={value!r} is not an integer") from None
    return None


def placement_from_env(env: Mapping[str, str], hostname: str) -> Placement:
    """torchrun's RANK/WORLD_SIZE win over srun's SLURM_PROCID/SLURM_NTASKS; default 1 rank."""
    rank = _env_int(env, "RANK", "SLURM_PROCID") or 0
    world = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS") or 1
    local = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID") or 0
    if not 0 <= rank < world:
        raise TopologyError(f"rank {rank} is outside a world of {world}")
    node = env.get("SLURMD_NODENAME") or hostname
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = expand_nodelist(nodelist) if nodelist else (node,)
    return Placement(rank=rank, world_size=world, local_rank=local, node=node, nodes=nodes)


@dataclass(frozen=True)
class NodeFixture:
    xid: int | None = None
    card_bytes_lost: int = 0
    cotenant_bytes: int = 0
    cotenant_pid: int | None = None

    def card(self, card_gib: float) -> Card:
        return Card(
            card_gib=card_gib,
            lost_bytes=self.card_bytes_lost,
            cotenant_bytes=self.cotenant_bytes,
            cotenant_pid=self.cotenant_pid,
        )


def _non_negative_int(data: Mapping[str, object], key: str, source: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TopologyError(f"{source}: {key} must be a non-negative integer, got {value!r}")
    return value


def parse_fixture(text: str, source: str) -> NodeFixture:
    """Read the documented schema; anything else is an error that names the file."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TopologyError(f"{source}: not JSON: {error}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a JSON object")
    unknown = set(data) - {"xid", "card_bytes_lost", "cotenant_bytes", "cotenant_pid"}
    if unknown:
        raise TopologyError(f"{source}: unknown keys {sorted(unknown)}")
    xid = _non_negative_int(data, "xid", source)
    lost = _non_negative_int(data, "card_bytes_lost", source)
    if lost is None:
        lost = DEFAULT_XID_LOST_GIB * GIB if xid is not None else 0
    cotenant = _non_negative_int(data, "cotenant_bytes", source) or 0
    pid = _non_negative_int(data, "cotenant_pid", source)
    if cotenant and pid is None:
        pid = DEFAULT_COTENANT_PID
    return NodeFixture(xid=xid, card_bytes_lost=lost, cotenant_bytes=cotenant, cotenant_pid=pid)


def fixture_path(state_dir: str, node: str) -> Path:
    return Path(state_dir) / "nodes" / node / "fixture" / FIXTURE_NAME


def read_fixture(state_dir: str, node: str) -> NodeFixture:
    """The node's fixture, or a healthy card when the node has none."""
    path = fixture_path(state_dir, node)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return NodeFixture()
    except (OSError, UnicodeDecodeError) as error:
        raise TopologyError(f"{path}: cannot read: {error}") from None
    return parse_fixture(text, str(path))
