"""The choice of a job log's root failure, and the findings read from it.

Given every failure event the forward pass found (`log_analysis`), it takes the earliest root
failure: an OOM, a GPU fault or another exception, or a worker's death as its launcher
reported it (`death_lines.DEATH_LINES`, torchrun's Root Cause table, srun's task lines), with the
later line that explains a death which says no why. The cascade it sets off (collective
timeouts, broken communicators, the launcher's SIGTERMs; `failures.CASCADES`) is the root only
when nothing else failed, and after a cancel of the whole job (a time limit) nothing is. Then
who failed (rank, node), at which step, in which phase and frames, with which numbers.
"""

from __future__ import annotations

import re
from dataclasses import replace

from daemon.evidence.death_lines import SIGKILL, SRUN_EXIT, signal_of
from daemon.evidence.failures import CascadeKind
from daemon.evidence.frame_phases import phase_of_frames
from daemon.evidence.log_events import (
    MAX_REPORT_CHARS,
    Event,
    Frame,
    ScanState,
    Who,
    worker_death,
)
from daemon.evidence.log_lines import EXCEPTION, matchable
from daemon.evidence.oom import parse_oom_block
from daemon.evidence.oom_family import host_ram_is_certain
from daemon.evidence.phases import decide_phase
from daemon.evidence.records import GpuFault, LogFindings, OomFamily, OomReport, RootCause
from daemon.evidence.steps import StepMark
from daemon.evidence.units import bounded_int
from daemon.slurm.records import MAX_EXIT_CODE

HEAVY_KERNEL_FRAMES = 6  # the allocation happened in the innermost frames, not in the caller chain
_HEAVY_KERNELS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"attn|attention|sdpa|scaled_dot_product|flash_", re.IGNORECASE)),
    (
        "moe_dispatch",
        re.compile(r"moe|experts?\b|dispatch|all_?to_?all|permut|grouped_gemm|router", re.I),
    ),
    (
        "cublas_matmul",
        re.compile(
            r"\blinear\b|matmul|\bbmm\b|baddbmm|addmm|cublas|\bmm\(|(?<!grouped_)gemm", re.I
        ),
    ),
    ("cudnn_conv", re.compile(r"conv[123]d|_conv_forward|convolution|cudnn", re.IGNORECASE)),
)
_TABLE_SIGNAL = re.compile(r"^Signal ([0-9]{1,3}) \(SIG[A-Z0-9]{1,10}\) received by PID")
_EXPLAINED = frozenset({"oom", "fault", "exception"})  # failures that say what went wrong
# TorchScript re-raises an error inside a scripted function under this sentence, then prints
# its own traceback (`~~~~ <--- HERE` markers) and the original error last
# (torch/csrc/jit/runtime/interpreter.cpp, handleError; tests/data/real/oom/144): the wrapper
# says no why, the error after it does.
_WRAPPER_EXCEPTION = re.compile(r"The following operation failed in the TorchScript interpreter")


def log_findings(state: ScanState, scanned: int) -> LogFindings:
    """What the log says of its failure, after the forward pass read `scanned` bytes into it."""
    table_death = _table_death(state)
    root, explanation = _choose_root(state, table_death)
    notes = list(state.notes)
    job_pids = tuple(sorted(state.job_pids))
    max_step = state.progress.max_step()
    if root is None:
        # Every death in view was the cascade or Slurm's kill after a cancel: its exit code or
        # signal (`tasks 0-3: Killed` after scancel) says nothing of the job's own failure.
        cancel = next((event for event in state.events if event.kind == "cancel"), None)
        if cancel is not None:
            notes.append(
                f"the job was stopped from outside before any rank failed: {cancel.text[:200]}"
            )
        else:
            notes.append(f"no failure message found in the last {scanned} bytes read")
        return LogFindings(
            max_step_seen=max_step,
            notes=tuple(notes),
            job_pids=job_pids,
            bytes_scanned=scanned,
        )
    evidence = explanation or root  # what the failure was; `root` says who failed first
    rank, node = _root_rank_and_node(state, root, table_death, notes)
    if explanation is not None and _other_processes(root, explanation):
        # Ray's raylet reports `Worker PID: 93658` dead, the error is `(WorkerDict pid=93663)`'s:
        # the dead worker's IP is not the failing worker's node (held-out sample 051)
        rank, node = explanation.rank, explanation.node
        notes.append(
            f"the death names process {root.pid}, the failure after it is process"
            f" {explanation.pid}'s: the death's rank and node are not the failing worker's"
        )
    elif (
        explanation is not None
        and explanation.rank is not None
        and (rank is not None or root.tasks is not None)  # srun's task list holds its rank
    ):
        rank, node = explanation.rank, explanation.node or node  # the dead worker's own words
    exit_code, signal = root.exit_code, root.signal
    if exit_code is None and signal is None:
        exit_code, signal = _exit_from_summaries(state, rank)
    cause = _root_cause(root, evidence)
    if cause is RootCause.HOST_RAM and signal is None:
        signal = 9
    if explanation is not None:
        notes.append(f"the first failure ({root.text[:120]}) is explained by a line after it")
    cascade_ranks = sorted(_cascade_ranks(state, root, table_death) - {rank})
    step = _step_at_failure(state, evidence)
    frames = _failing_frames(state, evidence)
    phase, phase_line = decide_phase(
        phase_of_frames(frames), state.progress.timeline.at(evidence.offset)
    )
    if root.kind == "cascade":
        notes.append(
            "only collective timeouts or errors were found: the rank that stalled first"
            " left no error in this log"
        )
    if state.rank_from_local_prefix:
        notes.append("ranks from torchrun's [defaultN] prefix are local ranks on their node")
    return LogFindings(
        rank=rank,
        node=node,
        step=None if step is None else step.step,
        max_step_seen=max_step,
        phase=phase,
        frames=tuple(frame.func for frame in frames),
        heavy_kernels=_heavy_kernels(frames),
        oom=_root_oom_report(evidence),
        root_failure_line=evidence.text[:MAX_REPORT_CHARS],
        cascade_ranks=tuple(cascade_ranks),
        exit_code=exit_code,
        killed_by_signal=signal,
        notes=tuple(notes),
        error_type=evidence.error_type,
        job_pids=job_pids,
        traceback_seen=bool(evidence.frames),
        bytes_scanned=scanned,
        root_cause=cause,
        gpu_fault=_gpu_fault(cause, evidence),
        step_line=None if step is None else step.line,
        phase_line=phase_line,
    )


def _root_oom_report(event: Event) -> OomReport | None:
    """The OOM report of the root failure: the single place its numbers are read.

    A device OOM is read with the lines its rank printed after it (`event.block`, prefixes
    stripped): a message wrapped over lines, or split by a prefix on every line, continues
    there. An error file's message (`event.source`) and a host-RAM line are read whole.
    """
    if event.family is None or event.family is OomFamily.HOST_RAM or event.source:
        return event.oom()
    report = parse_oom_block((event.text, *event.block))
    return report if report is not None else event.oom()


def _root_cause(root: Event, evidence: Event) -> RootCause | None:
    if root.kind == "cascade":
        timeout = root.cascade is CascadeKind.TIMEOUT
        return RootCause.COLLECTIVE_TIMEOUT if timeout else RootCause.OTHER_ERROR
    return evidence.cause


def _gpu_fault(cause: RootCause | None, evidence: Event) -> GpuFault | None:
    if cause is not RootCause.GPU_FAULT or evidence.fault is None:
        return None
    return replace(evidence.fault, line=evidence.text[:MAX_REPORT_CHARS])


def _cascade_ranks(state: ScanState, root: Event, table_death: Event | None) -> set[int]:
    """Ranks that failed after the root: collective timeouts, SIGTERMs, the table's others."""
    ranks = {
        event.rank
        for event in state.events
        if event.rank is not None and event.kind in {"cascade", "death"} and event is not root
    }
    if table_death is not None:
        ranks.update(
            entry.rank
            for entry in state.table
            if entry.rank is not None and entry.rank != table_death.rank
        )
    return ranks


def _step_at_failure(state: ScanState, failure: Event) -> StepMark | None:
    """The step the failing rank reached (`ProgressTracker.step_at_failure`): its own lines count
    where its rank is known, up to the collective timeouts its failure caused."""
    cascade_at = min(
        (e.offset for e in state.events if e.kind == "cascade" and e.offset > failure.offset),
        default=None,
    )
    own_lines = failure.rank is not None and failure.kind != "cascade"
    return state.progress.step_at_failure(
        failure.offset, failure.rank, own_lines=own_lines, cascade_at=cascade_at
    )


def _failing_frames(state: ScanState, failure: Event) -> tuple[Frame, ...]:
    """The failing stack: the failure's own traceback, or the one its rank printed after the
    message (stderr printed the message first: samples 030, 049, 050), either ending in the
    same message again or cut off by the excerpt's end."""
    if failure.frames:
        return failure.frames
    key = _failure_key(failure)
    for event in state.events:
        later = event.offset > failure.offset and event.rank == failure.rank
        if later and event.frames and key is not None and _failure_key(event) == key:
            return event.frames
    open_tracebacks = [
        rank_state.frames
        for rank, rank_state in state.ranks.items()
        if rank_state.in_traceback
        and rank_state.frames
        and (rank == failure.rank or failure.rank is None)
    ]
    return tuple(open_tracebacks[0]) if len(open_tracebacks) == 1 else ()


def _choose_root(state: ScanState, table_death: Event | None) -> tuple[Event | None, Event | None]:
    """The earliest root failure, and the later line that explains it when it says no why.

    Failures are what says what went wrong (an OOM, a GPU fault, another exception) and the
    deaths launchers report (`failed (exitcode: -9) local_rank: 3`, `Rank 1 crashed`, srun's
    `task 0: Exited with exit code 1`); the earliest is the root. A certain host-RAM kill (the
    OOM killer's or Slurm's own line, printed when the step ends) explains an earlier exception
    or death, not an earlier GPU OOM or fault. A death that says only its exit code or signal is
    explained by the first failure after it that could be the same process's. The cascade
    (timeouts, aborted communicators, SIGTERMs) is the root only when nothing else failed, and
    nothing after a cancel of the whole job (a time limit) is.
    """
    events = sorted([*state.events, *([table_death] if table_death else [])], key=_by_offset)
    cancel = next((event.offset for event in events if event.kind == "cancel"), None)
    live = [event for event in events if cancel is None or event.offset < cancel]
    failures = _failures(live)
    if failures:
        first = failures[0]
        certain = next((e for e in failures if _certain_host_ram(e)), None)
        if certain is not None and first.cause not in _DEVICE_CAUSES:
            return certain, None
        if first.cause is RootCause.OTHER_ERROR and (
            first.kind == "death" or _WRAPPER_EXCEPTION.search(matchable(first.text))
        ):
            later = (e for e in failures if e.offset > first.offset and e.kind in _EXPLAINED)
            explanation = next(later, None)
            if explanation is not None and _same_process(first, explanation):
                return first, explanation
        return first, _completed_name(first, failures)
    for kind in (CascadeKind.TIMEOUT, CascadeKind.COMM):
        cascade = next((e for e in live if e.kind == "cascade" and e.cascade is kind), None)
        if cascade is not None:
            return cascade, None
    return None, None


def _completed_name(first: Event, failures: list[Event]) -> Event | None:
    """The later line of the same exception with its message, when the root's line is only the
    exception's name (`jaxlib.xla_extension.XlaRuntimeError` as an issue's title, a post's first
    line: tests/data/real/oom/166); a bare `AssertionError` with no such line is its own why."""
    name = first.error_type
    if first.cause is not RootCause.OTHER_ERROR or name is None:
        return None
    if matchable(first.text).strip() != name:
        return None
    short = name.rsplit(".", 1)[-1]
    return next(
        (
            event
            for event in failures
            if event.offset > first.offset
            and event.error_type is not None
            and event.error_type.rsplit(".", 1)[-1] == short
            and _same_process(first, event)
        ),
        None,
    )


_DEVICE_CAUSES = frozenset({RootCause.ACCELERATOR_OOM, RootCause.GPU_FAULT})


def _by_offset(event: Event) -> int:
    return event.offset


def _failures(events: list[Event]) -> list[Event]:
    """Events that can be the root, in file order. A rank that reported a collective timeout
    or a broken communicator and then died of a signal or an exit code died of the cascade
    (the watchdog aborts the process: srun's `task 2: Aborted`). Once Slurm cancelled the step
    (`*** STEP 43575862.0 ON node CANCELLED AT ... ***`, after a task failed or by scancel), the
    tasks srun reports `Killed` were killed by Slurm (facebookresearch/deit#102)."""
    waited: set[int] = set()
    step_cancelled = False
    failures = []
    for event in events:
        if event.kind == "cascade":
            if event.rank is not None and event.cascade in _WAITING:
                waited.add(event.rank)
            step_cancelled = step_cancelled or _STEP_CANCELLED in event.text
        elif event.kind in _EXPLAINED:
            failures.append(event)
        elif event.kind == "death" and not _died_waiting(event, waited):
            slurm_killed = step_cancelled and event.launcher == "srun" and event.signal == SIGKILL
            if not slurm_killed:
                failures.append(event)
    return failures


_WAITING = frozenset({CascadeKind.TIMEOUT, CascadeKind.COMM})
_STEP_CANCELLED = "CANCELLED AT"


def _died_waiting(death: Event, waited: set[int]) -> bool:
    return death.cause is RootCause.OTHER_ERROR and not death.local_rank and death.rank in waited


def _other_processes(first: Event, second: Event) -> bool:
    """Whether two events name their processes, and not the same one."""
    return first.pid is not None and second.pid is not None and first.pid != second.pid


def _certain_host_ram(event: Event) -> bool:
    return event.cause is RootCause.HOST_RAM and host_ram_is_certain(event.source or event.text)


def _same_process(death: Event, failure: Event) -> bool:
    """Whether a failure could be the dead worker's own: one of them names no rank, or the
    death's rank (srun: its task list) holds the failure's, or they count ranks differently."""
    if death.rank is None or failure.rank is None:
        return True
    if death.tasks is not None:
        return failure.rank in death.tasks
    return death.local_rank != failure.local_rank or death.rank == failure.rank


def _table_death(state: ScanState) -> Event | None:
    """The Root Cause entry of torchrun's table as a death; of two agents' tables (two nodes'
    output in one log) the one with the earlier `time`. Where the excerpt lost the Root Cause
    section, the earliest failure it still lists."""
    roots = [(index, entry) for index, entry in enumerate(state.table) if entry.root_cause]
    if not roots:
        roots = list(enumerate(state.table))
    if not roots:
        return None
    _, entry = min(roots, key=lambda pair: (pair[1].time is None, pair[1].time or "", pair[0]))
    signal = None
    if entry.traceback and (match := _TABLE_SIGNAL.match(entry.traceback)):
        signal = bounded_int(match.group(1), MAX_EXIT_CODE)
    text = f"torchrun's Root Cause table: rank {entry.rank} exitcode {entry.exitcode}"
    if entry.traceback:
        text += f" ({entry.traceback[:MAX_REPORT_CHARS]})"
    who = Who(entry.rank, node=entry.host)
    return worker_death(
        entry.offset, text, "torchrun table", who, exit_code=entry.exitcode, signal=signal
    )


def _root_rank_and_node(
    state: ScanState, root: Event, table_death: Event | None, notes: list[str]
) -> tuple[int | None, str | None]:
    """Who failed first and where. A root that names no rank takes it from the same failure
    printed again with a prefix, from torchrun's Root Cause table, or from the first death a
    launcher reported; its node from the line that gave the rank, the table, srun's lines, or
    the one host the log's shell prompts name."""
    if root.kind == "cascade":
        return None, None  # every rank timed out: the one that stalled is not in view
    rank, node, local = root.rank, root.node, root.local_rank
    if rank is None and (same := _same_failure(state, root)) is not None:
        rank, node, local = same.rank, node or same.node, same.local_rank
        notes.append(f"rank {rank} printed the same failure with its prefix")
    if rank is None and table_death is not None and table_death.rank is not None:
        rank, node = table_death.rank, node or table_death.node
        notes.append(f"rank {rank} taken from torchrun's Root Cause table")
    if rank is None and root.tasks is None:  # srun's `tasks 2-7` said who: none of them alone
        deaths = sorted((e for e in state.events if e.kind == "death"), key=_by_offset)
        death = next((e for e in deaths if e.rank is not None and e is not root), None)
        if death is not None:
            rank, node, local = death.rank, node or death.node, death.local_rank
            notes.append(f"rank {rank} taken from the launcher's line: {death.text[:160]}")
    if local and rank is not None:
        notes.append(f"rank {rank} is the rank on its node the launcher named (local rank)")
    listed = [(host, tasks) for host, tasks, _ in state.srun_errors if tasks.first is not None]
    failed = [
        (host, tasks)
        for host, tasks, what in state.srun_errors
        if tasks.first is not None and "Terminated" not in what and "Killed" not in what
    ] or listed
    if node is None and rank is not None:
        node = next((e.host for e in state.table if e.rank == rank and e.host), None)
    if node is None and rank is not None:
        node = next((host for host, tasks in failed + listed if rank in tasks), None)
    if node is None and len({host for host, _ in failed}) == 1:
        node = failed[0][0]
    if node is None and len(state.prompt_hosts) == 1:
        node = state.prompt_hosts[0]
        notes.append(f"node {node} taken from the shell prompt in the log")
    return rank, node


def _same_failure(state: ScanState, root: Event) -> Event | None:
    """The root's failure printed again later by a line that names its rank: an unprefixed
    `CUDA error: uncorrectable ECC error` and then rank 1's watchdog reporting the same error."""
    key = _failure_key(root)
    if key is None:
        return None
    return next(
        (
            event
            for event in state.events
            if event.offset > root.offset and event.rank is not None and _failure_key(event) == key
        ),
        None,
    )


def _failure_key(event: Event) -> str | None:
    if event.kind == "fault" and event.fault is not None:
        return event.fault.words
    if event.kind in ("oom", "exception"):
        exception = EXCEPTION.match(matchable(event.text))
        message = exception.group("message") if exception else None
        return (message or event.text).strip() or None
    return None


def _exit_from_summaries(state: ScanState, rank: int | None) -> tuple[int | None, int | None]:
    """The exit code and signal the launchers reported for `rank` (any rank when unknown)."""
    for _, tasks, what in state.srun_errors:
        if rank is not None and rank not in tasks:
            continue
        if match := SRUN_EXIT.search(what):
            code = bounded_int(match.group("exit"), MAX_EXIT_CODE)
            if code is not None:
                return code, signal_of(code, None)
        if what.startswith("Killed"):
            return None, 9
    for entry in state.table:
        if entry.exitcode is not None and (rank is None or entry.rank == rank):
            return entry.exitcode, signal_of(entry.exitcode, None)
    for event in state.events:
        named = event.exit_code is not None or event.signal is not None
        if event.kind == "death" and named and (rank is None or event.rank == rank):
            return event.exit_code, event.signal
    return None, None


def _heavy_kernels(frames: tuple[Frame, ...]) -> tuple[str, ...]:
    """Heavy kernels among the innermost frames: where the failed allocation was made."""
    found: list[str] = []
    innermost = frames[-HEAVY_KERNEL_FRAMES:]
    for label, pattern in _HEAVY_KERNELS:
        for frame in innermost:
            if pattern.search(f"{frame.func} {frame.path.rsplit('/', 1)[-1]} {frame.code}"):
                found.append(label)
                break
    return tuple(found)
