"""`make demo` (interim): bring the local cluster up, fail a 4-node job, show what Slurm says.

This stands in for the full scenario until the daemon exists: it exercises the Slurm layer
end to end (submit as the job's owner, wait, read accounting and slurmctld) and prints the
typed record slurm-medic would diagnose.
"""

from __future__ import annotations

import pwd
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from daemon import process
from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import JobNotFound, SlurmError
from daemon.slurm.paths import PathContext, expand_std_path
from daemon.slurm.records import PathSource, SlurmJob

REPO = Path(__file__).resolve().parent.parent
JOB_USER = "alice"
OUTPUT_PATTERN = "%x-%j.out"
JOB_NAME = "demo-train-4node"
# The training step is a stand-in: rank 2 fails; the log line says plainly it is not real.
SCRIPT = """#!/bin/bash
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
echo "[slurm-medic demo] FAKE training log: this job only pretends; rank 2 will exit 1"
srun bash -c 'echo "rank $SLURM_PROCID on $SLURMD_NODENAME: step 0"; \
if [ "$SLURM_PROCID" = 2 ]; then echo "rank 2: simulated failure (demo)" >&2; exit 1; fi'
"""

console = Console()


def main() -> int:
    console.print(
        Panel(
            "Interim demo: the slurm-medic daemon does not exist yet. This brings the local "
            "cluster up, submits a failing 4-node job as alice, and prints what the Slurm "
            "access layer reads of it.",
            title="slurm-medic",
        )
    )
    bring_up_cluster()
    cli = SlurmCli(timeout_s=30, attempts=3, backoff_s=1.0)
    work_dir = prepare_work_dir()
    token = f"medic-demo-{uuid.uuid4().hex[:8]}"
    try:
        job_id = cli.submit(
            SCRIPT,
            as_user=JOB_USER,
            comment=token,
            work_dir=work_dir,
            extra_args=[f"--job-name={JOB_NAME}", f"--output={OUTPUT_PATTERN}"],
        )
    except SlurmError as error:
        console.print(f"[red]submission failed:[/red] {error}")
        return 1
    console.print(f"submitted job [bold]{job_id}[/bold] as {JOB_USER} (comment {token})")
    try:
        job = wait_for_end(cli, job_id)
    except (SlurmError, TimeoutError) as error:
        console.print(f"[red]could not follow job {job_id}:[/red] {error}")
        return 1
    show(job, work_dir)
    return 0


def bring_up_cluster() -> None:
    """deploy/devcluster/up is idempotent: on a running cluster it returns in seconds."""
    console.print("[bold]deploy/devcluster/up[/bold]")
    try:
        result = process.run([str(REPO / "deploy" / "devcluster" / "up")], timeout=600)
    except process.CommandError as error:
        raise SystemExit(f"deploy/devcluster/up did not finish: {error}") from error
    console.print(result.stdout.rstrip(), markup=False, highlight=False)
    if not result.ok:
        console.print(result.stderr.rstrip(), markup=False, highlight=False)
        raise SystemExit(f"deploy/devcluster/up failed (exit {result.returncode})")


def prepare_work_dir() -> str:
    """A directory the job's owner can write its log into."""
    owner = pwd.getpwnam(JOB_USER)
    path = Path(owner.pw_dir) / "medic-demo"
    path.mkdir(exist_ok=True)
    process.run(["chown", f"{owner.pw_uid}:{owner.pw_gid}", str(path)], timeout=10, check=True)
    return str(path)


def wait_for_end(cli: SlurmCli, job_id: int, limit_s: float = 120) -> SlurmJob:
    """Poll until accounting holds the finished job's complete record.

    The std paths are kept from a read while slurmctld still knew the job: 22.05's
    accounting does not store them.
    """
    deadline = time.monotonic() + limit_s
    paths_seen: SlurmJob | None = None
    while time.monotonic() < deadline:
        try:
            job = cli.job(job_id)
        except JobNotFound:
            time.sleep(0.5)
            continue
        if job.std_paths_source is PathSource.CONTROLLER:
            paths_seen = job
        if job.state.is_terminal() and job.accounting_complete:
            if job.std_paths_source is PathSource.UNKNOWN and paths_seen is not None:
                return replace(
                    job,
                    stdout_path=paths_seen.stdout_path,
                    stderr_path=paths_seen.stderr_path,
                    std_paths_source=PathSource.CONTROLLER,
                )
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not finish within {limit_s:g}s")


def show(job: SlurmJob, work_dir: str) -> None:
    stdout_path = job.stdout_path
    if stdout_path is None:
        context = PathContext(
            job_id=job.job_id,
            name=job.name,
            user=job.user,
            first_node=job.batch_host,
        )
        stdout_path = expand_std_path(OUTPUT_PATTERN, context, work_dir=job.work_dir or work_dir)
        source = "expanded by slurm-medic from the submitted --output pattern"
    else:
        source = f"from {job.std_paths_source.value}"
    table = Table(title=f"What the Slurm layer reads of job {job.display_id}", show_lines=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    exit_text = "unknown" if job.exit_code is None else f"{job.exit_code}:{job.exit_signal}"
    rows = [
        ("job id", job.display_id),
        ("name", job.name),
        ("user", f"{job.user} (group {job.group})"),
        ("state", f"{job.state.value} (raw {job.state_raw!r})"),
        ("exit code", exit_text),
        ("derived exit code", _pair(job.derived_exit_code, job.derived_exit_signal)),
        ("nodes", ", ".join(job.nodes) or "-"),
        ("batch host", job.batch_host or "-"),
        ("submitted", _time(job.submit_time)),
        ("started", _time(job.start_time)),
        ("ended", _time(job.end_time)),
        ("stdout", f"{stdout_path}  ({source})"),
        ("comment", job.comment or "-"),
    ]
    for field, value in rows:
        table.add_row(field, escape(value))
    console.print(table)
    steps = Table(title="steps")
    for column in ("step", "name", "state", "exit", "nodes"):
        steps.add_column(column)
    for step in job.steps:
        steps.add_row(
            step.step_id,
            escape(step.name),
            step.state.value,
            _pair(step.exit_code, step.exit_signal),
            ", ".join(step.nodes),
        )
    console.print(steps)
    log = Path(stdout_path)
    if log.is_file():
        tail = log.read_bytes()[-2000:].decode("utf-8", errors="replace")
        console.print(Panel(tail.rstrip(), title=f"tail of {log}"), markup=False, highlight=False)
    console.print(
        "[dim]Interim demo: the daemon that diagnoses this failure and relaunches it is "
        "not built yet.[/dim]"
    )


def _pair(code: int | None, signal: int | None) -> str:
    return "unknown" if code is None else f"{code}:{signal if signal is not None else 0}"


def _time(moment: object) -> str:
    return "-" if moment is None else str(moment)


if __name__ == "__main__":
    sys.exit(main())
