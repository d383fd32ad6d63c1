"""torchrun's own reports of a worker's failure: the ChildFailedError table its agent prints
(every era's layout) and the elastic error file, a JSON document the worker wrote.

A format of its own beside the per-line analysis (`log_analysis`), which hands it each line
first: a table's `[i]:` entries and fields say who failed, with which exit code, under a
`Root Cause` heading that `root_failure` trusts over the lines around it.
"""

from __future__ import annotations

import json
import re

from daemon.evidence.log_events import (
    MAX_REPORT_CHARS,
    Event,
    Frame,
    ScanState,
    TableEntry,
    Who,
    add_frame,
    explained_event,
)
from daemon.evidence.log_lines import FRAME, matchable
from daemon.evidence.records import MAX_PID, MAX_RANK, RootCause
from daemon.evidence.units import MIB
from daemon.slurm.records import MAX_EXIT_CODE

MAX_JSON_CHARS = MIB  # an elastic error file is small; a bigger "JSON" line is not one
MAX_TABLE_ENTRIES = 4096  # one entry per failed worker of a node's agent
_ROOT_SECTION = re.compile(r"Root Cause(?: \(first observed failure\))?:\s{0,8}\Z")
_TABLE_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*\Z")
# torchrun's ChildFailedError table, every era: 1.9's `  rank: 0 (local_rank: 0)` and `  msg:`
# with the error file's JSON below it (sample 043), 1.10+'s aligned `  rank      : 0` (001, 044;
# torch/distributed/elastic/multiprocessing/errors/__init__.py `_FAILURE_FORMAT_TEMPLATE`).
_TABLE_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback|msg)\s*:\s?(.*)\Z")
# An entry's first field, which starts an entry where the excerpt lost its `[i]:` line.
_TABLE_TIME = re.compile(r"^\s{0,8}time\s{0,8}:\s?[0-9]{4}-[0-9]{2}-[0-9]{2}_[0-9]{2}:[0-9]{2}")
_TABLE_RANK = re.compile(r"(-?[0-9]+)(?: \(local_rank: ([0-9]+)\))?")
_TABLE_EXIT = re.compile(r"(-?[0-9]+)(?: \(pid: ([0-9]+)\))?")
# The `"message": "RuntimeError: ..."` line of the error file's JSON under `msg:`: a JSON string,
# read whole (its escapes are undone by the JSON parser).
_TABLE_MESSAGE = re.compile(r'^\s{0,64}"message":\s?(?P<string>"(?:[^"\\]|\\.){0,8192}")')
_TABLE = "torchrun's failure table"


def table_line(state: ScanState, offset: int, body: str) -> bool:
    """torchrun's ChildFailedError table: `Root Cause (first observed failure):` (1.9: `Root
    Cause:`), then `[i]:` entries of fields; `i` is an index, not a rank."""
    stripped = body.strip()
    if _ROOT_SECTION.match(stripped):
        state.in_root_section = True
        return True
    if stripped.startswith(("Failures:", "Other Failures:")):
        state.in_root_section = False
        return True
    if _TABLE_ENTRY.match(body):
        if len(state.table) < MAX_TABLE_ENTRIES:
            state.table.append(TableEntry(root_cause=state.in_root_section, offset=offset))
        return True
    if not state.table or state.table[-1].complete:
        if not (_TABLE_TIME.match(body) and len(state.table) < MAX_TABLE_ENTRIES):
            return False
        state.table.append(TableEntry(root_cause=state.in_root_section, offset=offset))
    entry = state.table[-1]
    if entry.in_message and (message := _TABLE_MESSAGE.match(body)):
        _table_message(state, offset, entry, message.group("string"))
        entry.in_message, entry.complete = False, True
        return True
    match = _TABLE_FIELD.match(body)
    if match is None:
        return False
    key, value = match.group(1), match.group(2).strip()
    entry.in_message = key == "msg" and (not value or value.startswith("{"))
    if key == "time":
        entry.time = value[:40] or None
    elif key == "host":
        entry.host = value or None
    elif key == "rank" and (rank := _TABLE_RANK.match(value)):
        entry.rank = state.bounded(rank.group(1), MAX_RANK, "rank", _TABLE)
        entry.local_rank = state.bounded(rank.group(2), MAX_RANK, "local rank", _TABLE)
    elif key == "exitcode" and (code := _TABLE_EXIT.match(value)):
        entry.exitcode = state.bounded(code.group(1), MAX_EXIT_CODE, "exit code", _TABLE)
        entry.pid = state.bounded(code.group(2), MAX_PID, "process id", _TABLE)
        if entry.pid is not None:
            state.job_pids.add(entry.pid)
    elif key in ("traceback", "msg") and not entry.in_message:
        entry.traceback = value
    entry.complete = key in ("traceback", "msg") and not entry.in_message
    return True


def _table_message(state: ScanState, offset: int, entry: TableEntry, literal: str) -> None:
    """1.9's error file under `msg:`: its `"message"` is the worker's exception, of that rank."""
    try:
        message = json.loads(literal)
    except ValueError:
        return
    if not isinstance(message, str) or not message.strip():
        return
    text = message.strip()[:MAX_REPORT_CHARS]
    event = explained_event(offset, text, (), Who(entry.rank, node=entry.host), message)
    if event is not None:
        state.add_event(event)


def elastic_json(
    state: ScanState, offset: int, rank: int | None, node: str | None, body: str
) -> None:
    """torchrun's error file: {"message": {"message", "extraInfo": {"py_callstack"}}}."""
    if len(body) > MAX_JSON_CHARS:
        return
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the C stack allows
        return
    message = document.get("message") if isinstance(document, dict) else None
    callstack = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        if isinstance(stack, list):
            stack = "".join(part for part in stack if isinstance(part, str))
        if isinstance(stack, str):
            callstack = stack
        message = message.get("message")
    if not isinstance(message, str):
        return
    frames: list[Frame] = []
    for line in callstack.splitlines():
        if match := FRAME.match(matchable(line)):
            add_frame(frames, Frame(match.group("path"), match.group("func")))
    text = message.strip()[:MAX_REPORT_CHARS]
    event = explained_event(offset, text, tuple(frames), Who(rank, node=node), message)
    if event is None:  # an error file records a failure, whatever its words
        event = Event(offset, "exception", rank, node, text, tuple(frames))
        event.cause = RootCause.OTHER_ERROR
    state.add_event(event)
