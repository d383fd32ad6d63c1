"""`slurm-medic diagnose`: what killed this job, from its log files or from the local cluster.

With JOBID the Slurm calls take the settings' `slurm_timeout_s`: `--config`'s, else the system
config's (if there is one), else the default; under sudo only the system config counts
(`context.CommandContext`). A log is read without settings, as typed from the current
directory (`paths`), with the caller's own rights: under sudo `--log` is refused, since root
would read it for them.

Exit codes:
  0  a verdict was printed (whatever its kind, `unknown` included)
  2  usage error (no log and no job id, both, a bad step pattern, --config without JOBID, a
     config that cannot be used or may not be chosen here, --log under sudo)
  3  a log could not be read (missing, a FIFO, a symlink without --follow-symlinks, no rights)
  4  the Slurm layer could not answer for the job id
"""

from __future__ import annotations

import re
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from daemon.commands.context import (
    CommandContext,
    CommandFailed,
    Output,
    config_option,
    json_option,
    require_own_rights,
)
from daemon.commands.paths import typed_path
from daemon.diagnosis import Diagnosis, FailureKind, History
from daemon.evidence.findings import confine_to_allocation, merge_findings
from daemon.evidence.joblog import LogReadError, scan_log
from daemon.evidence.records import Evidence, LogFindings
from daemon.evidence.units import format_size
from daemon.rules.dispatch import diagnose, with_suspicious_text
from daemon.slurm.errors import SlurmError
from daemon.slurm.records import SlurmJob
from remediators.allocator import alloc_option

PREFIX = "slurm-medic diagnose"
EXIT_USAGE = 2
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
    callback=typed_path,
    metavar="FILE",
    help="A job log to read (repeat for several; e.g. one per rank).",
)
@json_option
@click.option("--step-pattern", help="Regex whose first group is the training step.")
@click.option("--follow-symlinks", is_flag=True, help="Read a log given through a symlink.")
@click.option(
    "--alloc-conf",
    metavar="VALUE",
    help="The run's PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) value, e.g."
    " expandable_segments:True: with expandable segments already on, stranded bytes are not"
    " read as fragmentation.",
)
@config_option
def diagnose_command(
    *,
    job_id: str | None,
    config_path: str | None,
    logs: tuple[str, ...],
    as_json: bool,
    step_pattern: str | None,
    follow_symlinks: bool,
    alloc_conf: str | None,
) -> None:
    """Diagnose a dead job: from --log FILE(s) offline, or from JOBID on the local cluster
    (whose Slurm calls take the config's slurm_timeout_s)."""
    if bool(job_id) == bool(logs):
        raise click.UsageError("give either JOBID or at least one --log FILE")
    if config_path is not None and not job_id:
        raise click.UsageError("--config is read only with JOBID (a log needs no settings)")
    if step_pattern is not None:
        try:
            if re.compile(step_pattern).groups < 1:
                raise click.UsageError("--step-pattern needs a group capturing the step")
        except re.error as error:
            raise click.UsageError(f"--step-pattern is not a regex: {error}") from error
    if logs:
        require_own_rights("slurm-medic diagnose --log", prefix=PREFIX)
    job: SlurmJob | None = None
    if job_id:
        context = CommandContext.load(config_path, prefix=PREFIX, config_exit=EXIT_USAGE)
        job = _job(context, job_id)
        paths = [path for path in (job.stdout_path, job.stderr_path) if path]
        if not paths:
            raise context.fail(
                f"job {job.display_id} has no known output file", exit_code=EXIT_SLURM
            )
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
    Output(as_json).emit(diagnosis_json(verdict), _print_human)


def _job(context: CommandContext, job_id: str) -> SlurmJob:
    try:
        return context.slurm().job(job_id)
    except (SlurmError, ValueError) as error:
        message = f"cannot get job {job_id} from Slurm: {error}"
        raise context.fail(message, exit_code=EXIT_SLURM) from error


def _scan(path: str, step_pattern: str | None, follow_symlinks: bool) -> LogFindings:
    try:
        return scan_log(path, step_pattern=step_pattern, follow_symlinks=follow_symlinks)
    except LogReadError as error:
        raise CommandFailed(str(error), exit_code=EXIT_UNREADABLE, prefix=PREFIX) from error


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


def _print_human(console: Console, shown: dict[str, Any]) -> None:
    """The verdict for a person, from the `--json` document with its strings (the node, the
    root-cause line, the reasons: the log's text) already escaped; rich markup in them is
    printed literally."""
    headline = shown["kind"]
    if shown["onset"]:
        headline += f" ({shown['onset']}"
        headline += f", {shown['mid_run_cause']})" if shown["mid_run_cause"] else ")"
    console.print(f"[bold]{escape(headline)}[/bold]  confidence {shown['confidence']}")
    where = [
        f"{label} {shown[label]}"
        for label in ("rank", "node", "step", "phase")
        if shown[label] is not None
    ]
    console.print(escape(", ".join(where)))
    if shown["root_cause"] is not None:
        cause = f"root cause {shown['root_cause']}"
        if shown["root_cause_line"]:
            cause += f": {' '.join(shown['root_cause_line'].split())[:200]}"
        console.print(escape(cause))
    console.print("\n[bold]Why[/bold]")
    for reason in shown["reasons"]:
        console.print(f"  - {escape(reason)}")
    oom = shown["oom"]
    if oom is not None:
        console.print("\n[bold]Numbers[/bold]")
        for label, key in (
            ("requested", "requested_bytes"),
            ("total", "total_bytes"),
            ("free", "free_bytes"),
            ("allocated", "allocated_bytes"),
            ("reserved but unallocated", "reserved_unallocated_bytes"),
            ("this process in use", "process_in_use_bytes"),
            ("allowed", "allowed_bytes"),
            ("other allocations", "other_allocations_bytes"),
        ):
            if oom[key] is not None:
                console.print(f"  {label}: {format_size(oom[key])} ({oom[key]} bytes)")
        for process in oom["other_processes"]:
            console.print(f"  process {process['pid']}: {format_size(process['bytes'])}")
    console.print("\n[bold]What to do[/bold]")
    console.print(f"  {escape(_NEXT_MOVES[FailureKind(shown['kind'])])}")
