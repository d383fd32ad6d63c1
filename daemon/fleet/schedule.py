"""When each node's turn in the sweep comes: once per interval, at its own moment of it.

Pure. A node's moment is a stable offset into the interval (a hash of its name), so a fleet
of a thousand nodes is probed a few at a time all interval long, never all at once, and a
restarted daemon keeps the same rhythm. A node is due once its latest moment has passed
since it was last checked, or since the sweep started for a node never checked: a first start
does not probe the whole fleet at once either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from datetime import datetime


def offset_s(node: str, interval_s: float) -> float:
    """The node's moment within each interval, in seconds from the interval's start."""
    digest = hashlib.sha256(node.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * interval_s


def latest_moment(node: str, now: datetime, interval_s: float) -> datetime:
    """The node's most recent moment at or before `now` (epoch-aligned intervals)."""
    offset = offset_s(node, interval_s)
    since_epoch = now.timestamp() - offset
    periods = since_epoch // interval_s
    return datetime.fromtimestamp(periods * interval_s + offset, tz=now.tzinfo)


def due_nodes(
    nodes: Iterable[str],
    last_checked: Mapping[str, datetime],
    *,
    now: datetime,
    interval_s: float,
    started: datetime,
) -> list[str]:
    """The nodes whose moment came since their last check (or since `started`)."""
    due = []
    for node in nodes:
        since = last_checked.get(node, started)
        if latest_moment(node, now, interval_s) > since:
            due.append(node)
    return due
