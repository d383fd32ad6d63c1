"""sdiag: the argv and the parser of the DBD Agent queue size, the messages slurmctld still
holds for slurmdbd.

A job that ended while slurmdbd was away exists nowhere yet: slurmctld may already have
forgotten it (MinJobAge) and accounting has no record of it until this queue drains. So the
accounting cursor must not move past a moment while that queue is not empty, or those
records would be skipped for good when they land behind it.
"""

from __future__ import annotations

import json
from typing import Any

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import MAX_COUNT

SDIAG_ARGV: tuple[str, ...] = ("sdiag",)

# sdiag prints a few kilobytes; anything longer than this is not sdiag's answer.
MAX_SDIAG_TEXT = 1024 * 1024
# The exact label, at the start of a stripped line. "Agent queue size:" (without "DBD") is
# slurmctld's own RPC retry queue towards the slurmd daemons, another number.
DBD_QUEUE_LABEL = "DBD Agent queue size:"
_SOURCE = "sdiag"
_JSON_SOURCE = "sdiag --json"


def parse_dbd_agent_queue(text: str) -> int:
    """The DBD Agent queue size from `sdiag` text (the header's `DBD Agent queue size: N`,
    documented from 17.11 on) or from `sdiag --json` (23.02+: `statistics.dbd_agent_queue_size`,
    a plain integer in the data_parser v0.0.39, v0.0.41 and v0.0.42 samples).

    Raises `SlurmParseError` when the text is over `MAX_SDIAG_TEXT` characters, when the
    line is absent (older releases, a trimmed or truncated paste), when it appears twice with
    different values, or when its value is not an integer from 0 to `MAX_COUNT`. One pass
    over the lines, no regular expression.
    """
    if len(text) > MAX_SDIAG_TEXT:
        raise SlurmParseError(
            f"{len(text)} characters is more than {MAX_SDIAG_TEXT}", source=_SOURCE
        )
    if text.lstrip().startswith("{"):
        return _parse_json(text)
    found: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith(DBD_QUEUE_LABEL):
            continue
        value = _count(stripped[len(DBD_QUEUE_LABEL) :].strip(), source=_SOURCE, line=stripped)
        if found is not None and found != value:
            raise SlurmParseError(
                f"{DBD_QUEUE_LABEL!r} appears twice, with {found} and {value}",
                source=_SOURCE,
                excerpt=stripped,
            )
        found = value
    if found is None:
        raise SlurmParseError(f"no {DBD_QUEUE_LABEL!r} line", source=_SOURCE, excerpt=text.lstrip())
    return found


def _count(value: str, *, source: str, line: str) -> int:
    """A decimal count as sdiag prints it: ASCII digits only, no sign, at most MAX_COUNT."""
    if not value or len(value) > len(str(MAX_COUNT)) or not (value.isascii() and value.isdigit()):
        raise SlurmParseError(
            f"DBD Agent queue size is not a non-negative integer: {value[:40]!r}",
            source=source,
            excerpt=line,
        )
    count = int(value)
    if count > MAX_COUNT:
        raise SlurmParseError(
            f"DBD Agent queue size {count} is more than {MAX_COUNT}", source=source, excerpt=line
        )
    return count


def _parse_json(text: str) -> int:
    try:
        data = json.loads(text, object_pairs_hook=_no_conflicting_keys)
    except ValueError as error:
        raise SlurmParseError(f"not JSON: {error}", source=_JSON_SOURCE, excerpt=text) from error
    if not isinstance(data, dict):
        raise SlurmParseError("not a JSON object", source=_JSON_SOURCE, excerpt=text)
    errors = data.get("errors")
    if isinstance(errors, list) and errors:
        raise SlurmParseError(
            f"sdiag reported errors: {json.dumps(errors)[:400]}", source=_JSON_SOURCE
        )
    statistics = data.get("statistics")
    if not isinstance(statistics, dict):
        raise SlurmParseError("no statistics object", source=_JSON_SOURCE, excerpt=text)
    if "dbd_agent_queue_size" not in statistics:
        raise SlurmParseError("no statistics.dbd_agent_queue_size", source=_JSON_SOURCE)
    value = statistics["dbd_agent_queue_size"]
    # bool is an int in Python; a no-value struct {"set": ..., "number": ...} is not what
    # any release prints here, so it is refused rather than guessed at.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise SlurmParseError(
            f"statistics.dbd_agent_queue_size is not an integer from 0 to {MAX_COUNT}: "
            f"{json.dumps(value)[:80]}",
            source=_JSON_SOURCE,
        )
    return value


def _no_conflicting_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a key given twice with different values is refused (the default
    keeps the last one silently)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result and result[key] != value:
            raise ValueError(f"key {key!r} appears twice with different values")
        result[key] = value
    return result
