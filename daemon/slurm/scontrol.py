"""scontrol: argv builders for node updates and parsers of `show node -o` / `show job -o`.

22.05 has no `scontrol --json`, so its one-line `Key=Value` text is parsed here; values may
hold spaces (OS, Reason, WorkDir, JobName), so fields are cut only where a `Key=` follows
whitespace. Newer releases' `scontrol --json show node` is read too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from typing import Any

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import NODE_NAME, expand_hostlist
from daemon.slurm.records import (
    MAX_COUNT,
    MAX_EPOCH_SECONDS,
    MAX_JOB_ID,
    MEDIC_REASON_PREFIX,
    NodeBaseState,
    RejectedRecord,
    SlurmNode,
)
from daemon.slurm.sacct_parsable import local_time

# Bounds on what one call may print before it is read: a whole cluster's nodes, one job.
MAX_NODES_TEXT = 64 * 1024 * 1024
MAX_JOB_TEXT = 1024 * 1024
_FIELD_START = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
# `text [user@2026-11-22T03:12:58]`: the stamp slurmctld appends, read from the last `[`.
_REASON_STAMP = re.compile(r"\[(?P<user>[^@\]]+)@(?P<time>[0-9T:-]{1,32})\]\s*")
# Keys that may follow Reason= on a node line; anything else inside a reason is its text.
_AFTER_REASON = ("Comment", "Extra", "InstanceId", "InstanceType", "ResumeAfterTime")
_NODE_STATE_ALIASES = {"ALLOC": "ALLOCATED", "MIX": "MIXED", "DRAINED": "IDLE"}


def validate_node_name(name: str) -> str:
    """Node names reach argv; refuse anything that could read as an option or a list."""
    if not NODE_NAME.fullmatch(name):
        raise ValueError(f"not a node name: {name[:80]!r}")
    return name


def validate_reason(reason: str) -> str:
    """A drain reason slurm-medic sets: prefixed `medic:`, one printable line."""
    if not reason.startswith(MEDIC_REASON_PREFIX):
        raise ValueError(f"drain reasons set by slurm-medic start with {MEDIC_REASON_PREFIX!r}")
    if any(not char.isprintable() for char in reason):
        raise ValueError("a drain reason must be one printable line")
    return reason


def show_node_argv(name: str | None = None) -> list[str]:
    argv = ["scontrol", "--oneliner", "show", "node"]
    return [*argv, validate_node_name(name)] if name is not None else argv


def show_job_argv(job_id: str) -> list[str]:
    return ["scontrol", "--oneliner", "show", "job", job_id]


def drain_argv(name: str, reason: str) -> list[str]:
    """The reason is one argv element: scontrol takes it whole, no shell ever sees it."""
    return [
        "scontrol",
        "update",
        f"NodeName={validate_node_name(name)}",
        "State=DRAIN",
        f"Reason={validate_reason(reason)}",
    ]


def resume_argv(name: str) -> list[str]:
    return ["scontrol", "update", f"NodeName={validate_node_name(name)}", "State=RESUME"]


def split_fields(line: str) -> dict[str, str]:
    """`Key=Value Key=Value with spaces` into a dict; a value runs until the next `Key=`."""
    starts = list(_FIELD_START.finditer(line))
    if not starts:
        raise SlurmParseError("no Key=Value fields", source="scontrol", excerpt=line)
    fields: dict[str, str] = {}
    for index, match in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(line)
        fields.setdefault(match.group(1), line[match.end() : end].rstrip())
    return fields


@dataclass(frozen=True)
class NodeReport:
    """The nodes one call described, and the records among them that could not be read."""

    nodes: tuple[SlurmNode, ...]
    rejected: tuple[RejectedRecord, ...] = ()


def parse_show_nodes(text: str, *, local_tz: tzinfo | None = None) -> NodeReport:
    """Every node of `scontrol --oneliner show node` (one line each, `NodeName=` first).

    A record that cannot be read (no NodeName, a name that is not a node name) is rejected
    alone; SlurmParseError only when the text is too long or no record could be read.
    """
    source = "scontrol show node"
    if len(text) > MAX_NODES_TEXT:
        raise SlurmParseError(
            f"{len(text)} characters is more than {MAX_NODES_TEXT}", source=source
        )
    records = [chunk for chunk in re.split(r"(?m)^(?=NodeName=)", text) if chunk.strip()]
    nodes = []
    rejected = []
    for record in records:
        try:
            if not record.startswith("NodeName="):
                raise SlurmParseError(
                    "record does not start with NodeName=", source=source, excerpt=record
                )
            nodes.append(_node_from_fields(record.strip(), local_tz))
        except SlurmParseError as error:
            rejected.append(RejectedRecord.of(error))
    return _node_report(nodes, rejected, source)


def _node_report(nodes: list[SlurmNode], rejected: list[RejectedRecord], source: str) -> NodeReport:
    """Output whose every record is unreadable is not a partial answer: it is an error."""
    if rejected and not nodes:
        first = rejected[0]
        raise SlurmParseError(
            f"no node could be read ({len(rejected)} rejected); the first: {first.reason}",
            source=source,
            excerpt=first.excerpt,
        )
    return NodeReport(nodes=tuple(nodes), rejected=tuple(rejected))


def _node_from_fields(record: str, local_tz: tzinfo | None) -> SlurmNode:
    fields = split_fields(record)
    name = fields.get("NodeName", "")
    if not NODE_NAME.fullmatch(name):
        raise SlurmParseError(
            "NodeName is not a node name", source="scontrol show node", excerpt=record
        )
    reason_text, reason_user, reason_time = _split_reason(_reason_value(record), local_tz)
    base, flags = parse_node_state(fields.get("State", "UNKNOWN"))
    return SlurmNode(
        name=name,
        address=_none_if_null(fields.get("NodeAddr")),
        state=base,
        flags=flags,
        reason=reason_text,
        reason_user=reason_user,
        reason_time=reason_time,
        gres=_none_if_null(fields.get("Gres")),
    )


def _reason_value(record: str) -> str | None:
    """Reason may hold `Key=`-like text: it runs to the end or to a key known to follow it."""
    marker = re.search(r"(?:^|\s)Reason=", record)
    if marker is None:
        return None
    rest = record[marker.end() :]
    cut = re.search(r"\s(?:" + "|".join(_AFTER_REASON) + r")=", rest)
    return (rest[: cut.start()] if cut else rest).rstrip()


def _split_reason(
    value: str | None, local_tz: tzinfo | None
) -> tuple[str | None, str | None, datetime | None]:
    if value is None or value in {"", "(null)", "none"}:
        return None, None, None
    opening = value.rfind("[")
    stamp = _REASON_STAMP.fullmatch(value, opening) if opening >= 0 else None
    if stamp is None:
        return value, None, None
    text = value[:opening].rstrip()
    return text, stamp.group("user"), local_time(stamp.group("time"), local_tz)


def parse_node_state(text: str) -> tuple[NodeBaseState, frozenset[str]]:
    """`IDLE+DRAIN`, `DOWN*+DRAIN`, `MIXED+DRAIN+NOT_RESPONDING`: base state and flags.

    A trailing `*` (not responding) becomes the NOT_RESPONDING flag, as newer releases print it.
    """
    parts = [part for part in text.strip().upper().split("+") if part]
    if not parts:
        return NodeBaseState.UNKNOWN, frozenset()
    flags = set(parts[1:])
    base_text = parts[0]
    if base_text.endswith("*"):
        base_text = base_text.rstrip("*")
        flags.add("NOT_RESPONDING")
    if base_text in {"DRAINED", "DRAINING", "DRAIN"}:
        flags.add("DRAIN")
    base_text = _NODE_STATE_ALIASES.get(base_text, base_text)
    try:
        base = NodeBaseState(base_text)
    except ValueError:
        flags.add(base_text)
        base = NodeBaseState.UNKNOWN
    return base, frozenset(flags)


def parse_nodes_json(text: str) -> NodeReport:
    """`scontrol --json show node` of 23.02 and later (state as a list of words)."""
    source = "scontrol --json show node"
    if len(text) > MAX_NODES_TEXT:
        raise SlurmParseError(
            f"{len(text)} characters is more than {MAX_NODES_TEXT}", source=source
        )
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise SlurmParseError(f"invalid JSON: {error}", source=source, excerpt=text) from error
    raw_nodes = document.get("nodes") if isinstance(document, dict) else None
    if not isinstance(raw_nodes, list):
        raise SlurmParseError("no `nodes` list", source=source)
    nodes = []
    rejected = []
    for raw in raw_nodes:
        try:
            nodes.append(_node_from_json(raw))
        except SlurmParseError as error:
            rejected.append(RejectedRecord.of(error))
    return _node_report(nodes, rejected, source)


def _node_from_json(raw: object) -> SlurmNode:
    if not isinstance(raw, dict):
        raise SlurmParseError(
            "a node is not an object", source="scontrol --json show node", excerpt=repr(raw)
        )
    name = raw.get("name")
    if not isinstance(name, str) or not NODE_NAME.fullmatch(name):
        raise SlurmParseError(
            "name is not a node name", source="scontrol --json show node", excerpt=repr(name)
        )
    states = raw.get("state") or []
    words = [str(word) for word in (states if isinstance(states, list) else [states])]
    base, flags = parse_node_state("+".join(words) if words else "UNKNOWN")
    return SlurmNode(
        name=name,
        address=_none_if_null(_text(raw.get("address"))),
        state=base,
        flags=flags,
        reason=_text(raw.get("reason")),
        reason_user=_text(raw.get("reason_set_by_user")),
        reason_time=_epoch(raw.get("reason_changed_at")),
        gres=_text(raw.get("gres")),
    )


@dataclass(frozen=True)
class ControllerJob:
    """What slurmctld still knows of a job that accounting of 22.05 does not store."""

    job_id: int
    name: str
    user: str
    state_raw: str
    batch_host: str | None
    nodes: tuple[str, ...]
    work_dir: str | None
    stdout_path: str | None
    stderr_path: str | None
    restart_count: int


_JOB_NAME = re.compile(r"\sJobName=(?P<name>.*?)\sUserId=(?=\S+\([0-9]+\)\sGroupId=)", re.S)
_USER = re.compile(r"\sUserId=(?P<user>[^\s(]+)\((?P<uid>[0-9]+)\)\sGroupId=")
_COUNT = re.compile(r"[0-9]{1,10}")


def parse_show_job(text: str) -> ControllerJob:
    """One job of `scontrol --oneliner show job ID` (the whole output is one record).

    The job name is cut between `JobName=` and the `UserId=name(uid) GroupId=` that always
    follows it, so a name holding `Key=` text or a newline still comes out whole.
    """
    if len(text) > MAX_JOB_TEXT:
        raise SlurmParseError(
            f"{len(text)} characters is more than {MAX_JOB_TEXT}", source="scontrol show job"
        )
    record = text.strip("\n")
    if not record.startswith("JobId="):
        raise SlurmParseError(
            "does not start with JobId=", source="scontrol show job", excerpt=record
        )
    name_match = _JOB_NAME.search(record)
    user_match = _USER.search(record)
    if name_match is None or user_match is None:
        raise SlurmParseError(
            "no JobName/UserId fields", source="scontrol show job", excerpt=record
        )
    tail = split_fields(record[user_match.start() :].lstrip())
    head = split_fields(record[: name_match.start()])
    job_id = _count(head.get("JobId"), "JobId", record, low=1, high=MAX_JOB_ID)
    if job_id is None:
        raise SlurmParseError("JobId is not a number", source="scontrol show job", excerpt=record)
    return ControllerJob(
        job_id=job_id,
        name=name_match.group("name"),
        user=user_match.group("user"),
        state_raw=tail.get("JobState", "UNKNOWN"),
        batch_host=_none_if_null(tail.get("BatchHost")),
        nodes=expand_hostlist(_none_if_null(tail.get("NodeList"))),
        work_dir=_none_if_null(tail.get("WorkDir")),
        stdout_path=_none_if_null(tail.get("StdOut")),
        stderr_path=_none_if_null(tail.get("StdErr")),
        restart_count=_count(tail.get("Restarts"), "Restarts", record, low=0, high=MAX_COUNT) or 0,
    )


def _count(value: str | None, what: str, record: str, *, low: int, high: int) -> int | None:
    """ASCII digits within `low..high` (str.isdigit() also takes "²", which int() refuses)."""
    if value is None or value == "":
        return None
    if not _COUNT.fullmatch(value) or not low <= int(value) <= high:
        raise SlurmParseError(
            f"{what} is not a count in {low}..{high}", source="scontrol show job", excerpt=record
        )
    return int(value)


def _epoch(value: Any) -> datetime | None:
    """A plain int or the no-value struct of newer releases; None where unset or implausible."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set") else None
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return datetime.fromtimestamp(value, tz=UTC) if 0 < value <= MAX_EPOCH_SECONDS else None


def _none_if_null(value: str | None) -> str | None:
    if value is None or value in {"", "(null)", "N/A", "n/a"}:
        return None
    return value


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None
