"""The forward pass over a job log's kept lines: what each line adds to the `ScanState`.

Lines of different ranks interleave, so each rank's traceback is tracked apart; a line is read
in order as a traceback's start or frame, torchrun's table (`log_tables`), a launcher's summary
(srun's task errors, the agent's pids), NCCL's size line, a shell prompt, a piece of a wrapped
death line, and last as a failure (`_failure_event`: a cancel, a worker's death, an OOM, a GPU
fault, the cascade, another exception). Choosing among the failures is `root_failure`'s.
"""

from __future__ import annotations

import re
from dataclasses import replace

from daemon.evidence.death_lines import (
    DEATH_DETAILS,
    DEATH_LINES,
    DETAIL_WITHIN_LINES,
    SIGNALS,
    SRUN_ERROR,
    SRUN_EXIT,
    WRAPPED_CHARS,
    WRAPPED_HEADS,
    WRAPPED_WITHIN_LINES,
)
from daemon.evidence.failures import CANCEL, cascade_kind
from daemon.evidence.launchers import (
    C10_MESSAGE_RANK,
    DEFAULT_GROUP,
    RANK_BLOCK_END,
    RANK_BLOCK_START,
    SHELL_PROMPT,
    RankKind,
)
from daemon.evidence.log_events import (
    Event,
    Frame,
    RankState,
    ScanState,
    Tasks,
    Who,
    Wrapped,
    add_note,
    explained_event,
    worker_death,
)
from daemon.evidence.log_lines import (
    EXCEPTION,
    FRAME,
    RICH_FRAME,
    TRACEBACK_START,
    matchable,
    node_of,
    split_prefixes,
)
from daemon.evidence.log_tables import elastic_json, table_line
from daemon.evidence.oom import nccl_request_bytes
from daemon.evidence.records import MAX_PID, MAX_RANK, OomFamily
from daemon.evidence.units import bounded_int
from daemon.slurm.records import MAX_EXIT_CODE

MAX_TASK_RANGES = 64  # srun prints a node's tasks as a few ranges (`0-3,5`)
MAX_SRUN_ERRORS = 4096  # one `srun: error:` line per node and failure
OOM_BLOCK_LINES = 8  # lines after an OOM line of the same rank that may continue its message
MAX_PROMPT_HOSTS = 8
_CLOSING_SIGNAL = re.compile(r"Sending process ([0-9]+) closing signal")
_ELASTIC_PID = re.compile(r"local_rank: [0-9]{1,7} \(pid: ([0-9]{1,10})\)")


def analyse_line(state: ScanState, offset: int, text: str) -> None:
    """Read one kept line (file order) into `state`."""
    state.line_index += 1
    found, whole = split_prefixes(text)
    rank, source, node = found.rank, found.kind, node_of(found, whole)
    if source == "local":
        state.rank_from_local_prefix = True
    if source is not None and rank is None:
        state.note(f"a {source} rank prefix beyond {MAX_RANK} was dropped")
    state.progress.read(offset, rank, text, state.note)
    body = matchable(whole)
    if source is None:
        rank = _rank_from_block(state, body)
    _continue_oom_block(state, rank, body)
    rank_state = state.ranks.setdefault(rank, RankState())
    if TRACEBACK_START in body:
        rank_state.frames = []
        rank_state.in_traceback = True
        return
    if table_line(state, offset, body):
        return
    if match := FRAME.match(body):
        rank_state.add_frame(Frame(match.group("path"), match.group("func")))
        rank_state.in_traceback = True
        return
    if rank_state.in_traceback and "│" in body and (match := RICH_FRAME.search(body)):
        rank_state.add_frame(Frame(match.group("path"), match.group("func")))
        return
    if rank_state.in_traceback and body.startswith(" ") and rank_state.frames:
        last = rank_state.frames[-1]
        if not last.code:
            rank_state.frames[-1] = Frame(last.path, last.func, body.strip())
        return
    _summary_line(state, body)
    if _attach_nccl_size(state, body):
        return
    if whole.lstrip().startswith("{") and '"message"' in whole:
        elastic_json(state, offset, rank, node, whole)
        return
    if "@" in body and (prompt := SHELL_PROMPT.match(body)):
        _remember_prompt(state, prompt.group("host"))
        return
    _wrapped_piece(state, offset, text, body)
    who = Who(rank, source == RankKind.LOCAL, node, found.pid)
    event = _failure_event(state, offset, body, rank_state, who)
    if event is not None:
        state.add_event(event)
        rank_state.in_traceback = False


def _rank_from_block(state: ScanState, body: str) -> int | None:
    """The rank of an unprefixed line inside a launcher's per-rank block (Composer's dump of a
    crashed rank's stderr between `Begin global rank N STDERR` and its `End`)."""
    if "global rank" in body:
        if start := RANK_BLOCK_START.search(body):
            state.block_rank = _bounded_rank(state, start.group("rank"))
            return None
        if RANK_BLOCK_END.search(body):
            state.block_rank = None
            return None
    return state.block_rank


def _bounded_rank(state: ScanState, digits: str) -> int | None:
    rank = bounded_int(digits, MAX_RANK)
    if rank is None:
        state.note(f"a rank beyond {MAX_RANK} was dropped")
    return rank


def _continue_oom_block(state: ScanState, rank: int | None, body: str) -> None:
    """Keep the lines after an OOM line of the same rank: a message wrapped over lines, or split
    by a prefix on every line, continues there (up to `OOM_BLOCK_LINES`). A wrapped line that
    reads like an OOM itself (`Process 1246069 has 577.00 MiB memory in use.`) opens a block of
    its own and still continues the one before it."""
    events = state.open_blocks.get(rank)
    if not events:
        return
    for event in events:
        event.block.append(body)
    state.open_blocks[rank] = [event for event in events if len(event.block) < OOM_BLOCK_LINES]


def _remember_prompt(state: ScanState, host: str) -> None:
    if host not in state.prompt_hosts and len(state.prompt_hosts) < MAX_PROMPT_HOSTS:
        state.prompt_hosts.append(host)


def _failure_event(
    state: ScanState, offset: int, body: str, rank_state: RankState, who: Who
) -> Event | None:
    """What failure a line that is no traceback frame reports, tested in order: a cancel of the
    whole job, a launcher's report of a worker's death, an OOM, a GPU fault, the cascade, any
    other exception. None when it reports none."""
    stripped = body.strip()
    if who.rank is None and "Rank " in body and (named := C10_MESSAGE_RANK.search(body)):
        group = named.group("group")
        if group is None or DEFAULT_GROUP.search(group):  # a subgroup's rank is not the job's
            who = replace(who, rank=_bounded_rank(state, named.group("rank")), local=False)
    if CANCEL.search(body):
        return Event(offset, "cancel", who.rank, who.node, stripped)
    death = _death_event(state, offset, body, who)
    if death is not None:
        return death
    if _complete_death(state, body):
        return None
    event = explained_event(offset, stripped, _frames(rank_state), who)
    if event is not None:
        return event
    kind = cascade_kind(body)
    if kind is None:
        return None
    exception = EXCEPTION.match(stripped)  # `DistBackendError: NCCL error ...`, with its stack
    return Event(
        offset,
        "cascade",
        who.rank,
        who.node,
        stripped,
        _frames(rank_state) if exception else (),
        exception.group("type") if exception else None,
        cascade=kind,
        local_rank=who.local,
    )


def _death_event(state: ScanState, offset: int, body: str, who: Who) -> Event | None:
    """A launcher's line saying a worker died (`death_lines.DEATH_LINES`, srun's task lines)."""
    for line in DEATH_LINES:
        if line.literal is not None and line.literal not in body:
            continue
        match = line.pattern.search(body)
        if match is None:
            continue
        offset, body = _unwrapped(state, line.name, offset, body)
        groups = _groups(line.pattern.search(body) or match)
        for detail in line.details:
            if more := detail.search(body):
                groups.update(_groups(more))
        if "rank" in groups:
            who = replace(who, rank=_bounded_rank(state, groups["rank"]), local=False)
        elif "local_rank" in groups:
            who = replace(who, rank=_bounded_rank(state, groups["local_rank"]), local=True)
        if "host" in groups:
            who = replace(who, node=groups["host"])
        if "pid" in groups:
            who = replace(who, pid=bounded_int(groups["pid"], MAX_PID))
        signal = state.bounded(groups.get("signal"), MAX_EXIT_CODE, "signal")
        return worker_death(
            offset,
            body.strip(),
            line.name,
            who,
            exit_code=state.bounded(groups.get("exit"), MAX_EXIT_CODE, "exit code"),
            signal=signal if signal is not None else SIGNALS.get(groups.get("signame", "")),
        )
    if "srun: error:" in body and (match := SRUN_ERROR.search(body)):
        return _srun_death(state, offset, body.strip(), match)
    return None


def _wrapped_piece(state: ScanState, offset: int, text: str, body: str) -> None:
    """Collect the pieces of a launcher's death line hard-wrapped over lines: a head (as
    printed, prefixes included) opens it, each next line is a piece, for a few lines."""
    head_text = matchable(text)
    for head in WRAPPED_HEADS:
        if head.literal in head_text and head.pattern.search(head_text):
            state.wrapped = Wrapped(head.name, offset, state.line_index, [body])
            return
    wrapped = state.wrapped
    if wrapped is None:
        return
    if state.line_index - wrapped.line_index > WRAPPED_WITHIN_LINES:
        state.wrapped = None
    elif sum(len(piece) for piece in wrapped.pieces) < WRAPPED_CHARS:
        wrapped.pieces.append(body)


def _unwrapped(state: ScanState, name: str, offset: int, body: str) -> tuple[int, str]:
    """The whole of a death line whose end `body` is, where its head and pieces came before
    (joined as printed: a terminal wraps mid-word), at the head's offset; else `body`."""
    wrapped = state.wrapped
    if wrapped is None or wrapped.name != name:
        return offset, body
    state.wrapped = None
    if len(wrapped.pieces) < 2:
        return offset, body  # the head held the end too: a whole line
    return wrapped.offset, matchable("".join(wrapped.pieces))


def _groups(match: re.Match[str]) -> dict[str, str]:
    """A launcher pattern's groups that matched; `signame2` is another spelling of `signame`."""
    return {
        key.rstrip("0123456789"): value
        for key, value in match.groupdict().items()
        if value is not None
    }


def _srun_death(state: ScanState, offset: int, text: str, match: re.Match[str]) -> Event | None:
    """srun's `task N: Exited with exit code 1` / `Killed` / `Out Of Memory` (cgroup OOM kill)."""
    what = match.group("what").strip()
    tasks = _task_ids(match.group("tasks"), state.notes)
    # a task list names the failing task only when it is one task (`tasks 1-3` does not say
    # which of them failed first: held-out sample 023)
    single = len(tasks.ranges) == 1 and tasks.ranges[0][0] == tasks.ranges[0][1]
    who = Who(rank=tasks.first if single else None, node=match.group("host"))
    if "Out Of Memory" in what:
        event = worker_death(
            offset, text, "srun", who, exit_code=None, signal=None, out_of_memory=True
        )
    elif code := SRUN_EXIT.search(what):
        exit_code = state.bounded(code.group("exit"), MAX_EXIT_CODE, "exit code")
        event = worker_death(offset, text, "srun", who, exit_code=exit_code, signal=None)
    elif (signal := SIGNALS.get(what.removesuffix("(core dumped)").strip())) is not None:
        event = worker_death(offset, text, "srun", who, exit_code=None, signal=signal)
    else:
        return None
    event.tasks = tasks
    return event


def _complete_death(state: ScanState, body: str) -> bool:
    """A line that completes the death its launcher reported just before (Open MPI's `Exit
    code:` after `Process name:`)."""
    for detail in DEATH_DETAILS:
        if detail.literal not in body or (match := detail.pattern.search(body)) is None:
            continue
        recent = reversed(state.events[-DETAIL_WITHIN_LINES:])
        event = next((e for e in recent if e.launcher == detail.name), None)
        if event is None or state.line_index - event.line_index > DETAIL_WITHIN_LINES:
            continue
        exit_code = state.bounded(match.groupdict().get("exit"), MAX_EXIT_CODE, "exit code")
        signal = state.bounded(match.groupdict().get("signal"), MAX_EXIT_CODE, "signal")
        node = match.groupdict().get("host") or event.node
        completed = worker_death(
            event.offset,
            event.text,
            detail.name,
            Who(event.rank, event.local_rank, node, event.pid),
            exit_code=exit_code if exit_code is not None else event.exit_code,
            signal=signal if signal is not None else event.signal,
        )
        completed.line_index = event.line_index
        state.events[state.events.index(event)] = completed
        return True
    return False


def _frames(rank_state: RankState) -> tuple[Frame, ...]:
    return tuple(rank_state.frames) if rank_state.in_traceback else ()


def _attach_nccl_size(state: ScanState, body: str) -> bool:
    """NCCL names the size it failed to allocate on the WARN line after its OOM line."""
    size = nccl_request_bytes(body)
    if size is None:
        return False
    for event in reversed(state.events[-4:]):
        oom = event.oom() if event.family is OomFamily.NCCL else None
        if oom is not None and oom.requested_bytes is None:
            event.parsed = replace(oom, requested_bytes=size)
            return True
    return False


def _summary_line(state: ScanState, body: str) -> None:
    """srun's per-task errors and torchrun's agent lines: who died, where, the job's pids."""
    srun = SRUN_ERROR.search(body) if "srun: error:" in body else None
    if srun is not None and len(state.srun_errors) < MAX_SRUN_ERRORS:
        tasks = _task_ids(srun.group("tasks"), state.notes)
        state.srun_errors.append((srun.group("host"), tasks, srun.group("what").strip()))
    for pattern in (_ELASTIC_PID, _CLOSING_SIGNAL):
        if match := pattern.search(body):
            _add_pid(state, match.group(1))


def _add_pid(state: ScanState, digits: str) -> None:
    pid = bounded_int(digits, MAX_PID)
    if pid is None:
        state.note(f"a process id beyond {MAX_PID} was dropped")
    else:
        state.job_pids.add(pid)


def _task_ids(text: str, notes: list[str]) -> Tasks:
    """srun's `0-3,5` as ranges, in the order printed; ranks beyond `MAX_RANK` are dropped."""
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        low_text, _, high_text = part.partition("-")
        if not (low_text.isdigit() and (high_text or low_text).isdigit()):
            continue  # not a task id (`,,`, `1-2-3`)
        low = bounded_int(low_text, MAX_RANK)
        high = bounded_int(high_text or low_text, MAX_RANK)
        if low is None or high is None:
            add_note(notes, f"srun task ids beyond {MAX_RANK} were dropped")
            continue
        if low <= high and (low, high) not in ranges:
            if len(ranges) == MAX_TASK_RANGES:
                add_note(notes, f"an srun task list of more than {MAX_TASK_RANGES} ranges was cut")
                break
            ranges.append((low, high))
    return Tasks(tuple(ranges))
