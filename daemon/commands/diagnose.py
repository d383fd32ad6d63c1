"""`slurm-medic diagnose`: what killed this job, from its log files or from the local cluster.

Exit codes:
  0  a verdict was printed (whatever its kind, `unknown` included)
  2  usage error (no log and no job id, both, a bad step pattern)
  3  a log could not be read (missing, a FIFO, a symlink without --follow-symlinks, no rights)
  4  the Slurm layer could not answer for the job id
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from daemon.commands.terminal import printable
from daemon.diagnosis import Diagnosis, FailureKind, History
from daemon.evidence.findings import confine_to_allocation, merge_findings
from daemon.evidence.joblog import LogReadError, scan_log
from daemon.evidence.records import Evidence, LogFindings
from daemon.evidence.units import format_size
from daemon.rules.dispatch import diagnose, with_suspicious_text
from daemon.slurm.errors import SlurmError
from daemon.slurm.records import SlurmJob
from remediators.allocator import alloc_option

EXIT_UNREADABLE = 3
EXIT_SLURM = 4

_NEXT_MOVES = {
    FailureKind.HARDWARE: "Drain the node (reason prefixed `medic:`) and relaunch excluding it.",
    FailureKind.COTENANT: "Exclude the node, report the process; do not cut the batch.",
    FailureKind.HOST_RAM: "Fewer data loader workers or smaller host buffers; keep the model.",
    FailureKind.FRAGMENTATION: (
        "PYTORCH_ALLOC_CONF=expandable_segments:True, then max_split_size_mb near the largest"
        " recurring temporary, then garbage_collection_threshold. No batch cut."
    ),
    FailureKind.TRUE_OOM: (
        "Micro-batch down with grad-accum up (global batch kept), then selective recompute,"
        " then full recompute, then more sharding."
    ),
    FailureKind.WORKSPACE_SPIKE: (
        "Less sequence pressure in the heavy-kernel layers, or recompute of that module."
    ),
    FailureKind.OPTIMIZER_BURST: (
        "Partition the optimizer state (distributed optimizer / ZeRO-1) or an 8-bit optimizer."
    ),
    FailureKind.EVAL_GROWTH: "Smaller eval batch, eval_accumulation_steps, an explicit KV cap.",
    FailureKind.NOT_OOM: "Not out of memory: nothing to propose; read the failure above.",
    FailureKind.UNKNOWN: "Nothing to propose on this evidence.",
}


@click.command("diagnose")
@click.argument("job_id", required=False)
@click.option(
    "--log",
    "logs",
    multiple=True,
    type=click.Path(dir_okay=True, path_type=str),
    help="A job log to read (repeat for several; e.g. one per rank).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--step-pattern", help="Regex whose first group is the training step.")
@click.option("--follow-symlinks", is_flag=True, help="Read a log given through a symlink.")
@click.option(
    "--alloc-conf",
    metavar="VALUE",
    help="The run's PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) value, e.g."
    " expandable_segments:True: with expandable segments already on, stranded bytes are not"
    " read as fragmentation.",
)
def diagnose_command(
    *,
    job_id: str | None,
    logs: tuple[str, ...],
    as_json: bool,
    step_pattern: str | None,
    follow_symlinks: bool,
    alloc_conf: str | None,
) -> None:
    """Diagnose a dead job: from --log FILE(s) offline, or from JOBID on the local cluster."""
    if bool(job_id) == bool(logs):
        raise click.UsageError("give either JOBID or at least one --log FILE")
    if step_pattern is not None:
        try:
            if re.compile(step_pattern).groups < 1:
                raise click.UsageError("--step-pattern needs a group capturing the step")
        except re.error as error:
            raise click.UsageError(f"--step-pattern is not a regex: {error}") from error
    job: SlurmJob | None = None
    if job_id:
        job = _job(job_id)
        paths = [path for path in (job.stdout_path, job.stderr_path) if path]
        if not paths:
            _fail(f"job {job.display_id} has no known output file", EXIT_SLURM)
        logs = tuple(dict.fromkeys(paths))
    findings = merge_findings([_scan(path, step_pattern, follow_symlinks) for path in logs])
    if job is not None:
        findings = confine_to_allocation(findings, job)
    evidence = Evidence(
        log=findings,
        job=job,
        expandable_segments=None if alloc_conf is None else expandable_segments_on(alloc_conf),
    )
    verdict = with_suspicious_text(diagnose(evidence, History()), findings)
    if as_json:
        click.echo(json.dumps(diagnosis_json(verdict), indent=2))
    else:
        _print_human(verdict)


def _job(job_id: str) -> SlurmJob:
    from daemon.slurm.backend import SlurmCli  # noqa: PLC0415  (only the JOBID path needs Slurm)

    try:
        return SlurmCli().job(job_id)
    except (SlurmError, ValueError) as error:
        _fail(f"cannot get job {job_id} from Slurm: {error}", EXIT_SLURM)


def _scan(path: str, step_pattern: str | None, follow_symlinks: bool) -> LogFindings:
    try:
        return scan_log(path, step_pattern=step_pattern, follow_symlinks=follow_symlinks)
    except LogReadError as error:
        _fail(str(error), EXIT_UNREADABLE)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"slurm-medic diagnose: {message}", err=True)
    raise SystemExit(code)


def expandable_segments_on(alloc_conf: str) -> bool:
    """Whether a PYTORCH_[CUDA_]ALLOC_CONF value turns expandable segments on."""
    return (alloc_option(alloc_conf, "expandable_segments") or "").lower() == "true"


def diagnosis_json(verdict: Diagnosis) -> dict[str, Any]:
    """The `--json` object; every number in bytes, null where the message did not give it."""
    oom = verdict.oom
    return {
        "kind": verdict.kind.value,
        "onset": verdict.onset.value if verdict.onset else None,
        "mid_run_cause": verdict.mid_run_cause.value if verdict.mid_run_cause else None,
        "confidence": verdict.confidence.value,
        "reasons": list(verdict.reasons),
        "rank": verdict.rank,
        "node": verdict.node,
        "step": verdict.step,
        "phase": verdict.phase.value,
        "bad_nodes": list(verdict.bad_nodes),
        "cotenant_pids": list(verdict.cotenant_pids),
        "root_cause": verdict.root_cause.value if verdict.root_cause else None,
        "root_cause_line": verdict.root_cause_line,
        "oom": None
        if oom is None
        else {
            "family": oom.family.value,
            "requested_bytes": oom.requested_bytes,
            "total_bytes": oom.total_bytes,
            "free_bytes": oom.free_bytes,
            "allocated_bytes": oom.allocated_bytes,
            "reserved_bytes": oom.reserved_bytes,
            "reserved_unallocated_bytes": oom.reserved_unallocated_bytes,
            "process_in_use_bytes": oom.process_in_use_bytes,
            "private_pool_bytes": oom.private_pool_bytes,
            "other_processes": [{"pid": p.pid, "bytes": p.bytes} for p in oom.other_processes],
            "gpu_index": oom.gpu_index,
            "allowed_bytes": oom.allowed_bytes,
            "other_allocations_bytes": oom.other_allocations_bytes,
            "request_beyond_any_device": oom.request_beyond_any_device,
        },
    }


def _print_human(verdict: Diagnosis) -> None:
    console = Console(highlight=False, soft_wrap=True)
    headline = verdict.kind.value
    if verdict.onset:
        headline += f" ({verdict.onset.value}"
        headline += f", {verdict.mid_run_cause.value})" if verdict.mid_run_cause else ")"
    console.print(f"[bold]{escape(headline)}[/bold]  confidence {verdict.confidence.value}")
    where = [
        f"{label} {value}"
        for label, value in (
            ("rank", verdict.rank),
            ("node", verdict.node),
            ("step", verdict.step),
            ("phase", verdict.phase.value),
        )
        if value is not None
    ]
    console.print(escape(printable(", ".join(where))))  # the node comes from the log
    if verdict.root_cause is not None:
        cause = f"root cause {verdict.root_cause.value}"
        if verdict.root_cause_line:
            cause += f": {' '.join(verdict.root_cause_line.split())[:200]}"
        console.print(escape(printable(cause)))  # the line is the log's text
    console.print("\n[bold]Why[/bold]")
    for reason in verdict.reasons:
        console.print(f"  - {escape(printable(reason))}")  # reasons quote the log
    if verdict.oom is not None:
        console.print("\n[bold]Numbers[/bold]")
        oom = verdict.oom
        for label, value in (
            ("requested", oom.requested_bytes),
            ("total", oom.total_bytes),
            ("free", oom.free_bytes),
            ("allocated", oom.allocated_bytes),
            ("reserved but unallocated", oom.reserved_unallocated_bytes),
            ("this process in use", oom.process_in_use_bytes),
            ("allowed", oom.allowed_bytes),
            ("other allocations", oom.other_allocations_bytes),
        ):
            if value is not None:
                console.print(f"  {label}: {format_size(value)} ({value} bytes)")
        for process in oom.other_processes:
            console.print(f"  process {process.pid}: {format_size(process.bytes)}")
    console.print("\n[bold]What to do[/bold]")
    console.print(f"  {escape(_NEXT_MOVES[verdict.kind])}")
