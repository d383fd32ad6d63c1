"""Hostlist expressions (`gpu-[01-04]`): checked here, then expanded by ClusterShell's NodeSet.

NodeSet alone is not safe on text Slurm or a user wrote: it builds every index of a range
before anyone can ask its size (`n[0-99999999]` is 100 million integers), resolves `@group`
names through the site's group sources, reads `!`, `&` and `^` as set operators, takes
non-ASCII digits, and raises ValueError or AssertionError besides its own errors. So a
hostlist is first read by a small linear grammar (Slurm's own: names of `[A-Za-z0-9._-]`,
bracketed ranges of ASCII digits, never a digit right before a bracket, items separated by
commas) that counts the names it would make, and only a hostlist of at most `max_names`
names reaches NodeSet. Every name that comes
out is a valid node name. Everything else is a `SlurmParseError`, the only error raised here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from ClusterShell.NodeSet import NodeSet, NodeSetException

from daemon.slurm.errors import SlurmParseError

# Far beyond any cluster's node count, and small enough to expand in well under a second.
MAX_HOSTLIST_NAMES = 65_536
# 65,536 unrelated names of 16 characters and their commas fit.
MAX_HOSTLIST_CHARS = 1024 * 1024
# A host name as DNS allows it (253 characters), never something an option parser could read
# as an option (a leading dash) or a list (commas, brackets, spaces).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
# A run of digits NodeSet turns into an int: 18 fit a signed 64-bit index, far past any node.
_MAX_DIGITS = 18
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_DIGITS = frozenset("0123456789")
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
# What Slurm prints where a job has no nodes yet (or never got any).
_NO_NODES = frozenset({"", "none assigned", "(null)", "none", "n/a"})
# Only small answers are cached: a poll repeats the same few hostlists, and a cache of large
# expansions would be a way to hold the daemon's memory.
_CACHED_NAMES = 256


def expand_hostlist(text: str | None, *, max_names: int = MAX_HOSTLIST_NAMES) -> tuple[str, ...]:
    """Every node name of a hostlist, in NodeSet's order; empty for Slurm's "no nodes" words.

    The one bounded way to read a hostlist or node set from untrusted text: more than
    `max_names` names, or anything that is not a plain Slurm hostlist, is a SlurmParseError.
    """
    if text is None or text.strip().lower() in _NO_NODES:
        return ()
    stripped = text.strip()
    count = count_hostlist(stripped, max_names=max_names)
    if count <= _CACHED_NAMES:
        return _expand_small(stripped)
    return _expand(stripped)


def count_hostlist(text: str, *, max_names: int = MAX_HOSTLIST_NAMES) -> int:
    """How many names `text` would expand to (before duplicates fold), read without expanding.

    Raises SlurmParseError for anything that is not a hostlist, or that names more than
    `max_names` nodes.
    """
    if len(text) > MAX_HOSTLIST_CHARS:
        raise _error(f"{len(text)} characters is more than {MAX_HOSTLIST_CHARS}", text)
    total = 0
    for item in _items(text):
        total += _item_count(item, max_names, text)
        if total > max_names:
            raise _error(f"names more than {max_names} nodes", text)
    return total


def fold_hostlist(names: Iterable[str]) -> str:
    """The compact hostlist Slurm accepts on its command lines (`gpu-[01,03]`).

    Raises ValueError for a name that is not a node name or for more than
    MAX_HOSTLIST_NAMES names: these reach argv.
    """
    checked = []
    for name in names:
        if not NODE_NAME.fullmatch(name):
            raise ValueError(f"not a node name: {name[:80]!r}")
        checked.append(name)
        if len(checked) > MAX_HOSTLIST_NAMES:
            raise ValueError(f"more than {MAX_HOSTLIST_NAMES} node names")
    return str(NodeSet.fromlist(checked))


@lru_cache(maxsize=1024)
def _expand_small(text: str) -> tuple[str, ...]:
    return _expand(text)


def _expand(text: str) -> tuple[str, ...]:
    try:
        names = tuple(str(name) for name in NodeSet(text))
    except NodeSetException as error:
        raise _error(str(error), text) from error
    for name in names:
        if not NODE_NAME.fullmatch(name):
            raise _error(f"{name[:80]!r} is not a node name", text)
    return names


def _items(text: str) -> list[str]:
    """The comma-separated items at bracket depth 0; brackets never nest."""
    items: list[str] = []
    start = 0
    inside = False
    for position, char in enumerate(text):
        if char == "[":
            if inside:
                raise _error("a bracket inside a bracket", text)
            inside = True
        elif char == "]":
            if not inside:
                raise _error("a closing bracket without its opening one", text)
            inside = False
        elif char == "," and not inside:
            items.append(text[start:position])
            start = position + 1
    if inside:
        raise _error("a bracket is not closed", text)
    items.append(text[start:])
    return items


def _item_count(item: str, max_names: int, text: str) -> int:
    """Names of one item: the product of its bracket groups' sizes (checked as it grows)."""
    if not item:
        raise _error("an empty name", text)
    if item[0] in "._-" or (item[0] not in _NAME_CHARS and item[0] != "["):
        raise _error(f"{item[:80]!r} does not start like a node name", text)
    count = 1
    digits = 0
    position = 0
    while position < len(item):
        char = item[position]
        if char == "[":
            if digits:
                # NodeSet reads `n9[0-99]` as n90..n999, ten times the names Slurm means;
                # Slurm itself always prints the whole number inside the brackets.
                raise _error("a digit right before a bracket", text)
            end = item.index("]", position)
            count *= _group_size(item[position + 1 : end], text)
            if count > max_names:
                raise _error(f"names more than {max_names} nodes", text)
            digits = 0
            position = end + 1
            continue
        if char not in _NAME_CHARS:
            raise _error(f"{char!r} cannot be part of a node name", text)
        digits = digits + 1 if char in _DIGITS else 0
        if digits > _MAX_DIGITS:
            raise _error(f"a number longer than {_MAX_DIGITS} digits", text)
        position += 1
    return count


def _group_size(group: str, text: str) -> int:
    """`1-4,7` holds 5 indices; each range is ASCII digits, low before high."""
    size = 0
    for piece in group.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise _error(f"[{group[:80]}] is not a list of ranges", text)
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise _error(f"range {piece!r} runs backwards", text)
        size += high - low + 1
    return size


def _error(message: str, text: str) -> SlurmParseError:
    return SlurmParseError(message, source="hostlist", excerpt=text)
