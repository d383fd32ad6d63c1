"""Hostlist expressions (`gpu-[01-04]`) through ClusterShell's NodeSet, never by hand."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from ClusterShell.NodeSet import NodeSet, NodeSetException

from daemon.slurm.errors import SlurmParseError

# What Slurm prints where a job has no nodes yet (or never got any).
_NO_NODES = frozenset({"", "none assigned", "(null)", "none", "n/a"})


# A poll of thousands of jobs repeats the same few hostlists; NodeSet takes ~40 us each.
@lru_cache(maxsize=4096)
def expand_hostlist(text: str | None) -> tuple[str, ...]:
    """Every node name of a hostlist, in Slurm's order; empty for Slurm's "no nodes" words."""
    if text is None or text.strip().lower() in _NO_NODES:
        return ()
    try:
        return tuple(str(name) for name in NodeSet(text.strip()))
    except NodeSetException as error:
        raise SlurmParseError(str(error), source="hostlist", excerpt=text) from error


def fold_hostlist(names: Iterable[str]) -> str:
    """The compact hostlist Slurm accepts on its command lines (`gpu-[01,03]`)."""
    return str(NodeSet.fromlist(list(names)))
