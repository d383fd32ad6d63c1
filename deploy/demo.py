"""`make demo`: slurm-medic closing the loop on the local cluster, over real training runs.

Brings the cluster up, prepares a fresh record, starts `slurm-medic run`, then, as alice, four
stages whose jobs are real PyTorch runs (deploy/devcluster/real-train: torch on the CPU, with
transformers' Trainer for the HF stage, DDP over gloo across the namespace nodes, real
checkpoints and resumes):

1. the HF Trainer dies of fragmentation on one rank while the other hangs in the real gloo
   collective; the daemon cancels the wedged run, applies the allocator fix by policy and the
   relaunch resumes from the Trainer's own `checkpoint-N`;
2. two plain DDP runs die of a true OOM, one at step 0 (no checkpoint yet) and one mid-run
   after DCP checkpoints; the batch change waits for a person, alice approves both with the
   CLI, and the mid-run relaunch resumes from the DCP `step_N/`;
3. a run whose dataloader workers outgrow its --mem is killed by the kernel's cgroup OOM
   killer (Slurm: the step OUT_OF_MEMORY); the daemon halves the workers;
4. gpu-03 shows XID 79: drained, and the relaunch excludes it.

The runs of stages 1-3 are submitted together and play side by side (most of a stage is
waiting: for a timeout, a grace, a poll); stage 4 runs alone afterwards, because its XID
fixture would touch any run placed on gpu-03. It ends with `history` and `show` for one
lineage, stops the daemon with SIGTERM and leaves the cluster up. Exits 1 with the reason when
a stage misses its expected outcome. Only the CUDA OOM is injected (there is no GPU): each
run's first line says so. One file over 500 lines on purpose: it reads top to bottom as the
story it prints, one function per stage.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from sqlalchemy import select

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the end-to-end harness lives beside the tests

from daemon import process  # noqa: E402
from daemon.dialects import get_dialect  # noqa: E402
from daemon.dialects.base import Role  # noqa: E402
from daemon.store.models import AuditEvent, Incident, Proposal, TemplateRevision  # noqa: E402
from tests.e2e import (  # noqa: E402
    USER,
    Medic,
    Scenario,
    StageFailed,
    job_log,
    make_template,
    node_list,
    node_reason,
)

# alice owns it: her jobs write their logs and checkpoints there.
STATE_DIR = Path("/var/lib/slurm-medic-demo")
DEVCLUSTER = REPO / "deploy" / "devcluster"
DEVCLUSTER_STATE = Path("/var/lib/slurm-medic-devcluster")
SICK_NODE = "gpu-03"
# A real run starts in seconds (torch and transformers import on every rank); several share
# the machine's two cores, so a stage is given a few minutes.
STAGE_TIMEOUT_S = 300
# The daemon cancels a run whose log shows a rank's death after this long.
WEDGE_GRACE_S = 3
# Stage 1's survivors would hang this long in gloo: far past the grace, as NCCL's default 10
# minutes are.
WEDGE_TIMEOUT_S = 120
# The other runs' collective timeout: long enough that a rank busy starting up (two cores for
# several runs) never times out a healthy collective; a dead rank's peers are cancelled first.
RUN_TIMEOUT_S = 20
# The HF example saves every 10 steps; the fragmentation dies at step 4, so save every 2.
HF_SAVE_STEPS = 2
# Stage 3: each dataloader worker writes and holds this much (real-train's REALTRAIN_WORKER_MIB).
# A rank measured ~270 MiB and each worker ~150 MiB in all, so 16 workers (~2.6 GiB) pass the
# job's --mem and 8 (~1.5 GiB) stay well under it.
WORKER_MIB = 128
HOST_RAM_MEM = "2000M"
# One rank per node (and a --gres to match): every rank imports torch (and the HF stage's
# transformers), seconds of CPU each, and the machine has two cores for all the runs at once.
ONE_RANK = {"gpus_per_node": "1"}

FRAGMENTATION = Scenario(
    "demo-fragmentation",
    "hf-trainer",
    "fragmentation",
    ONE_RANK,
    one_rank_per_node=True,
    nccl_timeout_s=WEDGE_TIMEOUT_S,
)
TRUE_OOM_STEP0 = Scenario(
    "demo-true-oom-step0",
    "torchrun",
    "true-oom-step0",
    {**ONE_RANK, "micro_batch": "6", "grad_accum": "4"},
    one_rank_per_node=True,
    nccl_timeout_s=RUN_TIMEOUT_S,
)
TRUE_OOM_MIDRUN = Scenario(
    "demo-true-oom-midrun",
    "torchrun",
    "true-oom-midrun",
    ONE_RANK,
    one_rank_per_node=True,
    nccl_timeout_s=RUN_TIMEOUT_S,
)
HOST_RAM = Scenario(
    "demo-host-ram",
    "torchrun",
    "host-ram",
    {**ONE_RANK, "micro_batch": "2", "grad_accum": "8", "num_workers": "16"},
    one_rank_per_node=True,
    nccl_timeout_s=RUN_TIMEOUT_S,
    mem=HOST_RAM_MEM,
    env={"REALTRAIN_WORKER_MIB": str(WORKER_MIB)},
)
FAULTY_NODE = Scenario(
    "demo-faulty-node",
    "torchrun",
    "faulty-node",
    {**ONE_RANK, "nodes": "3"},
    one_rank_per_node=True,
    nccl_timeout_s=RUN_TIMEOUT_S,
)

# Library frames worth showing from a dead rank's traceback, one each, in the log's order.
SHOWN_FRAMES = (
    "transformers/trainer.py",
    "accelerate/",
    "torch/nn/parallel/distributed.py",
    "transformers/models/",
    "torch/nn/modules/module.py",
    "torch/autograd/",
    "torch/optim/",
)
FRAMES_SHOWN_MAX = 4
_FRAME = re.compile(r'\[rank(?P<rank>\d+)\]:\s+File "(?P<path>[^"]+)", line \d+, in \S+\Z')
SITE_PACKAGES = "site-packages/"
# A survivor's gloo error when its collective times out (the wedge stage expects none).
GLOO_TIMED_OUT = "Timed out waiting"
# The batch lines of a true-OOM revision's diff.
BATCH_DIFF_LINES = tuple(
    f"{sign}export {name}=" for name in ("MICRO_BATCH", "GRAD_ACCUM") for sign in "-+"
)
# How a relaunch says it resumed: the Trainer (HF), the plain DDP loop (DCP).
RESUME_MARKS = ("Loading model from", "Resuming training from", "resumed from checkpoint")

console = Console(highlight=False)


@dataclass
class Clock:
    """Seconds since the demo started, printed beside what the daemon did."""

    started: float

    def __call__(self) -> str:
        return f"[dim]{time.monotonic() - self.started:6.1f}s[/dim]"


clock = Clock(time.monotonic())


@dataclass(frozen=True)
class Run:
    """A first run submitted with `slurm-medic submit`: its lineage, job and template."""

    scenario: Scenario
    lineage: int
    job: int
    template: Path


@dataclass(frozen=True)
class StageTime:
    name: str
    seconds: float


def main() -> int:
    console.print(
        Panel(
            "slurm-medic on a real 4-node Slurm cluster (network namespaces on this machine).\n"
            "[bold]REAL[/bold]: Slurm and its accounting, the cgroup OOM kill of a job past "
            "its --mem, the training (torch DDP and the transformers Trainer on the CPU), the "
            "gloo collectives and their hang when a rank dies, the checkpoints (Trainer "
            "checkpoint-N/, torch.distributed.checkpoint step_N/) and the resumes.\n"
            "[bold]INJECTED[/bold]: the CUDA OOM and its numbers (there is no GPU): raised as "
            "torch.OutOfMemoryError inside the real step, with the message and figures of a "
            "modelled 80 GiB card; and gpu-03's XID 79 (a node fixture).",
            title="slurm-medic demo",
        )
    )
    bring_up_cluster()
    medic = start_daemon()
    times: list[StageTime] = []
    try:
        headline("Submitting the runs of stages 1-3 together; each stage below follows its own")
        fragmentation = submit(medic, FRAGMENTATION, "stage 1, HF Trainer")
        step0 = submit(medic, TRUE_OOM_STEP0, "stage 2, plain DDP")
        midrun = submit(medic, TRUE_OOM_MIDRUN, "stage 2, plain DDP")
        host_ram = submit(medic, HOST_RAM, "stage 3, plain DDP")
        times.append(stage_fragmentation(medic, fragmentation))
        times.extend(stage_true_oom(medic, step0, midrun))
        times.append(stage_host_ram(medic, host_ram))
        times.append(stage_faulty_node(medic))
        finale(medic, fragmentation.lineage, times)
    except StageFailed as error:
        console.print(f"\n[bold red]demo failed:[/bold red] {escape(str(error))}")
        console.print(f"daemon log: {medic.daemon_log}")
        return 1
    finally:
        stop_daemon(medic)
        restore_nodes(medic)
        cancel_leftovers()
    console.print(
        "\n[bold green]demo complete.[/bold green] The cluster is still up "
        "(`deploy/devcluster/status`); take it down with `make cluster-down` "
        f"(deploy/devcluster/down). The demo's record, logs and checkpoints are in {STATE_DIR}."
    )
    return 0


def headline(text: str) -> None:
    console.print(f"\n[bold cyan]== {text}[/bold cyan]")


def say(text: str) -> None:
    console.print(f"{clock()}  {text}")


def detail(text: str) -> None:
    console.print(f"           {text}")


def bring_up_cluster() -> None:
    headline("Cluster: deploy/devcluster/up")
    result = process.run([str(DEVCLUSTER / "up")], timeout=600)
    if not result.ok:
        console.print(escape(result.stdout + result.stderr))
        raise SystemExit(f"deploy/devcluster/up failed (exit {result.returncode})")
    sinfo = process.run(["sinfo", "-h", "-o", "%P %a %D %T %N"], timeout=30)
    say(f"up: {escape(sinfo.stdout.strip())}")


def start_daemon() -> Medic:
    headline("Daemon: fresh record, slurm-medic db upgrade, slurm-medic run")
    if STATE_DIR.exists():
        shutil.rmtree(STATE_DIR)
    STATE_DIR.mkdir(mode=0o755)
    shutil.chown(STATE_DIR, USER, USER)
    state = DEVCLUSTER_STATE
    medic = Medic(
        STATE_DIR,
        {
            "key_path": str(state / "medic_id_ed25519"),
            "known_hosts_path": str(state / "known_hosts"),
            "user": "medic",
        },
        wedge_grace_s=WEDGE_GRACE_S,
    )
    medic.prepare()
    medic.start()
    say(
        f"config {medic.config}: poll every {medic.poll_interval_s:g} s, a wedged run is "
        f"cancelled after {WEDGE_GRACE_S} s, record {medic.database}"
    )
    say(
        "the epilog hook is not wired in the dev cluster's slurm.conf: the daemon finds "
        "ended jobs by polling sacct"
    )
    return medic


def submit(medic: Medic, scenario: Scenario, what: str) -> Run:
    template = make_template(STATE_DIR, scenario)
    if scenario.example == "hf-trainer":
        save_every(template, HF_SAVE_STEPS)
    lineage, job, token = medic.submit(template)
    say(
        f"{what}, {scenario.scenario}: lineage L{lineage}, Slurm job {job} "
        f"(`slurm-medic submit`, token {token} in its comment)"
    )
    return Run(scenario, lineage, job, template)


def save_every(template: Path, steps: int) -> None:
    """The HF example's script saves every 10 steps; this run saves every `steps`."""
    script = template / "job.sbatch.j2"
    text = script.read_text(encoding="utf-8")
    if "--save_steps 10 " not in text:
        raise StageFailed(f"{script} no longer says --save_steps 10")
    script.write_text(text.replace("--save_steps 10 ", f"--save_steps {steps} "), "utf-8")


def wait(medic: Medic, what: str, probe: Callable[[], object]) -> None:
    medic.wait_for(what, probe, STAGE_TIMEOUT_S)


def report_diagnosis(
    medic: Medic, run: Run, evidence: Callable[[Incident], None] | None = None
) -> Proposal:
    """How the job ended, what `evidence` shows of it, the diagnosis and the proposal."""
    lineage = run.lineage

    def proposed_or_completed() -> bool:
        if medic.proposals(lineage):
            return True
        if f"{run.job} COMPLETED" in job_states(run.job):
            raise StageFailed(
                f"job {run.job} ({run.scenario.scenario}) completed instead of failing: "
                f"{', '.join(job_states(run.job))}"
            )
        return False

    wait(medic, f"L{lineage}: a diagnosis and a proposal", proposed_or_completed)
    incident: Incident = medic.incidents(lineage)[0]
    with medic.session() as session:
        diagnosis = session.get(Incident, incident.id)
        reasons = list(diagnosis.diagnosis.get("reasons", [])) if diagnosis else []
    say(f"job {run.job} ended: {escape(', '.join(job_states(run.job)))}")
    cancelled = wedge_cancel(medic, run.job)
    if cancelled is not None:
        say(
            f"the daemon had cancelled it as wedged (audit [bold]wedged_cancelled[/bold]: "
            f"a dead rank first seen {cancelled.details.get('first_seen')}, grace "
            f"{cancelled.details.get('grace_s')} s)"
        )
    if evidence is not None:
        evidence(incident)
    say(
        f"diagnosed [bold]{incident.kind}[/bold] ({incident.confidence} confidence) on "
        f"{incident.node}, rank {incident.rank}, {at_step(incident.step)}"
    )
    for reason in reasons:
        detail(f"because: {escape(str(reason))}")
    proposal = medic.proposals(lineage)[0]
    say(f"proposed [bold]{proposal.remediator}[/bold]: {escape(proposal.rationale)}")
    return proposal


def report_frames(run: Run, incident: Incident) -> None:
    """The dead rank's real library frames, as its traceback in the job's log shows them."""
    rank = incident.rank
    if rank is None:
        raise StageFailed(f"job {run.job}: the diagnosis names no rank")
    log = job_log(STATE_DIR, run.job)
    frames = library_frames(log, rank)
    if not frames:
        raise StageFailed(f"job {run.job}: no torch/transformers frames of rank {rank}")
    say(f"rank {rank}'s traceback in the log runs through the real libraries:")
    for frame in frames:
        detail(escape(frame))
    oom = [line for line in log.splitlines() if line.startswith(f"[rank{rank}]: torch.OutOf")]
    if oom:
        detail(f"[dim](injected)[/dim] {escape(oom[0][:160])}...")


def library_frames(log: str, rank: int) -> list[str]:
    """Up to FRAMES_SHOWN_MAX frame lines of `rank`'s traceback, one per SHOWN_FRAMES kind,
    in the log's order, with the path shortened to what follows site-packages/."""
    shown: list[str] = []
    kinds_seen: set[str] = set()
    for line in log.splitlines():
        match = _FRAME.match(line.strip())
        if match is None or int(match["rank"]) != rank:
            continue
        path = match["path"]
        kind = next((kind for kind in SHOWN_FRAMES if kind in path), None)
        if kind is None or kind in kinds_seen or SITE_PACKAGES not in path:
            continue
        kinds_seen.add(kind)
        short = path.split(SITE_PACKAGES, 1)[1]
        shown.append(line.strip().replace(path, short))
        if len(shown) == FRAMES_SHOWN_MAX:
            break
    return shown


def report_verified(medic: Medic, run: Run) -> Proposal:
    lineage = run.lineage
    wait(
        medic,
        f"L{lineage}: the relaunch verified",
        lambda: medic.proposal_in(lineage, ("verified", "failed", "rejected", "expired")),
    )
    proposal = medic.proposals(lineage)[-1]
    if proposal.state != "verified":
        raise StageFailed(f"L{lineage}: proposal {proposal.id} ended {proposal.state}")
    relaunch = proposal.relaunch_job_id or 0
    log = job_log(STATE_DIR, relaunch)
    say(f"relaunched as job {relaunch} (approved by {proposal.decided_by})")
    for line in resume_lines(log):
        say(f"relaunch log: {escape(line)}")
    say(
        f"[bold green]verified[/bold green]: it had failed {at_step(proposal.failing_step)}; "
        f"the relaunch reached step "
        f"{proposal.step_reached} and wrote a checkpoint; its log ends "
        f"{escape(log.strip().splitlines()[-1])}"
    )
    return proposal


def at_step(step: int | None) -> str:
    return "before any logged step" if step is None else f"at step {step}"


def resume_lines(log: str) -> list[str]:
    """What the relaunch's own code said about resuming, once each (every node's first rank
    logs the Trainer's lines)."""
    found: list[str] = []
    for line in log.splitlines():
        text = line.strip()
        if any(mark in text for mark in RESUME_MARKS) and text not in found:
            found.append(text)
    return found


def verified_after_s(medic: Medic, run: Run, proposal: Proposal) -> float:
    """Seconds from the lineage's first submission to its relaunch's verification."""
    with medic.session() as session:
        verified = session.scalars(
            select(AuditEvent.at).where(
                AuditEvent.verb == "proposal_verified", AuditEvent.subject_id == str(proposal.id)
            )
        ).first()
    if verified is None:
        raise StageFailed(f"L{run.lineage}: no proposal_verified event for proposal {proposal.id}")
    return (verified - medic.lineage(run.lineage).created_at).total_seconds()


def resumed_from(medic: Medic, run: Run, proposal: Proposal) -> Path | None:
    """The checkpoint the relaunch was told to resume from (its revision's resume knob)."""
    dialect = get_dialect(tomllib.loads((run.template / "template.toml").read_text())["dialect"])
    with medic.session() as session:
        revision = session.get(TemplateRevision, proposal.revision_id)
        value = revision.knobs.get(dialect.roles[Role.RESUME]) if revision else None
    return Path(value) if value else None


def revision_details(medic: Medic, proposal: Proposal) -> dict[str, Any]:
    """What the daemon recorded when it made the relaunch's revision: the diff, the
    checkpoint it resumes from (or why none)."""
    with medic.session() as session:
        event = session.scalars(
            select(AuditEvent).where(
                AuditEvent.verb == "revision", AuditEvent.subject_id == str(proposal.id)
            )
        ).first()
        if event is None:
            raise StageFailed(f"proposal {proposal.id}: no revision in the audit trail")
        return dict(event.details)


def wedge_cancel(medic: Medic, job: int) -> AuditEvent | None:
    with medic.session() as session:
        found = session.scalars(
            select(AuditEvent).where(
                AuditEvent.verb == "wedged_cancelled", AuditEvent.subject_id == str(job)
            )
        ).first()
        if found is not None:
            session.expunge(found)
        return found


def job_states(job: int) -> list[str]:
    """`JOBID STATE` of the job and each of its steps, from Slurm's accounting."""
    done = process.run(
        ["sacct", "-j", str(job), "-n", "-P", "-o", "JobID,State"], timeout=30, check=True
    )
    return [line.replace("|", " ") for line in done.stdout.splitlines() if line]


def hf_checkpoint_summary(path: Path) -> str:
    """What the Trainer wrote: its files, and trainer_state.json's step and log entries."""
    state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    files = sorted(item.name for item in path.iterdir())
    return (
        f"trainer_state.json global_step {state['global_step']}, "
        f"{len(state['log_history'])} log_history entries; files: {', '.join(files)}"
    )


def dcp_checkpoint_summary(path: Path) -> str:
    """What torch.distributed.checkpoint wrote: the per-rank shards and `.metadata`."""
    metadata = path / ".metadata"
    shards = sorted(item.name for item in path.glob("*.distcp"))
    return f".metadata ({metadata.stat().st_size} bytes), shards: {', '.join(shards)}"


def stage_fragmentation(medic: Medic, run: Run) -> StageTime:
    headline(
        "Stage 1: the HF Trainer dies of fragmentation; the other rank hangs in gloo until the "
        "daemon cancels it; the allocator fix is applied on its own"
    )

    def evidence(incident: Incident) -> None:
        if wedge_cancel(medic, run.job) is None:
            raise StageFailed(f"fragmentation: job {run.job} was not cancelled as wedged")
        if not any(state.startswith(f"{run.job} CANCELLED") for state in job_states(run.job)):
            raise StageFailed(f"fragmentation: job {run.job} is not CANCELLED")
        log = job_log(STATE_DIR, run.job)
        if GLOO_TIMED_OUT in log:
            raise StageFailed(f"fragmentation: job {run.job}'s survivors timed out in gloo first")
        for line in log.splitlines():
            if "CANCELLED AT" in line and "slurmstepd" in line:  # may follow a tqdm redraw
                detail(f"log: {escape(line[line.index('slurmstepd') :].strip())}")
        detail(
            "the surviving rank printed nothing after the death: it was still waiting in the "
            f"step's gloo allreduce, whose timeout ({WEDGE_TIMEOUT_S} s) never came"
        )
        report_frames(run, incident)

    proposal = report_diagnosis(medic, run, evidence)
    if proposal.remediator != "allocator_expandable_segments":
        raise StageFailed(f"fragmentation: expected expandable segments, got {proposal.remediator}")
    wait(
        medic,
        "auto-approval",
        lambda: medic.proposal_in(run.lineage, ("submitted", "verifying", "verified")),
    )
    say("policy approved it (allocator env is in policy.auto_approve; the science is unchanged)")
    verified = report_verified(medic, run)
    checkpoint = resumed_from(medic, run, verified)
    if checkpoint is None or not checkpoint.name.startswith("checkpoint-"):
        raise StageFailed("fragmentation: the relaunch did not resume from a checkpoint-N/")
    say(f"it resumed from {checkpoint}: {escape(hf_checkpoint_summary(checkpoint))}")
    return StageTime("1 fragmentation (HF Trainer, wedged)", verified_after_s(medic, run, verified))


def stage_true_oom(medic: Medic, step0: Run, midrun: Run) -> list[StageTime]:
    headline(
        "Stage 2: two true OOMs (plain DDP); the batch change waits for a person, alice approves it"
    )
    for run in (step0, midrun):
        proposal = report_diagnosis(medic, run, functools.partial(report_frames, run))
        if proposal.remediator != "micro_batch_down" or proposal.state != "proposed":
            raise StageFailed(
                f"true OOM: expected micro_batch_down waiting, got {proposal.remediator} "
                f"{proposal.state}"
            )
        time.sleep(1)
        if medic.proposals(run.lineage)[0].state != "proposed":
            raise StageFailed("true OOM: the batch change did not wait for a person")
        say("waiting for a person: micro_batch_down is not in policy.auto_approve")
        approve(medic, run, proposal)
    times = []
    for run in (step0, midrun):
        verified = report_verified(medic, run)
        revision = revision_details(medic, verified)
        for line in str(revision.get("diff", "")).splitlines():
            if line.startswith(BATCH_DIFF_LINES):
                detail(f"diff: {escape(line)}")
        checkpoint = resumed_from(medic, run, verified)
        if run is step0:
            if checkpoint is not None:
                raise StageFailed(f"step 0: the relaunch resumed from {checkpoint}")
            note = str(revision.get("checkpoint"))
            say(f"it died in its first step, before any checkpoint: {escape(note)}")
        else:
            if checkpoint is None or not checkpoint.name.startswith("step_"):
                raise StageFailed("mid-run: the relaunch did not resume from a DCP step_N/")
            say(f"it resumed from {checkpoint}: {escape(dcp_checkpoint_summary(checkpoint))}")
        times.append(
            StageTime(
                f"2 {run.scenario.scenario} (plain DDP)", verified_after_s(medic, run, verified)
            )
        )
    return times


def approve(medic: Medic, run: Run, proposal: Proposal) -> None:
    argv = [
        "approve",
        str(proposal.id),
        "--comment",
        "halve the micro-batch, keep the global batch",
    ]
    done = medic.cli(*argv, as_user=USER)
    say(
        f"alice: sudo slurm-medic approve {proposal.id} --comment '...' -> "
        f"{escape(done.stdout.strip())}"
    )


def stage_host_ram(medic: Medic, run: Run) -> StageTime:
    headline(
        f"Stage 3: 16 dataloader workers a rank outgrow the job's --mem={HOST_RAM_MEM}; the "
        "kernel's cgroup OOM killer ends it"
    )

    def evidence(incident: Incident) -> None:
        states = job_states(run.job)
        if not any(state.endswith("OUT_OF_MEMORY") for state in states):
            raise StageFailed(f"host RAM: no step of job {run.job} ended OUT_OF_MEMORY: {states}")
        log = job_log(STATE_DIR, run.job)
        for line in log.splitlines():
            if "oom-kill" in line or "Out Of Memory" in line:
                detail(f"log: {escape(line.strip())}")

    proposal = report_diagnosis(medic, run, evidence)
    incident = medic.incidents(run.lineage)[0]
    if incident.kind != "host_ram":
        raise StageFailed(f"host RAM: diagnosed {incident.kind}")
    if proposal.remediator != "dataloader_workers_down":
        raise StageFailed(f"host RAM: expected dataloader_workers_down, got {proposal.remediator}")
    verified = report_verified(medic, run)
    return StageTime("3 host RAM (cgroup OOM kill)", verified_after_s(medic, run, verified))


def stage_faulty_node(medic: Medic) -> StageTime:
    headline("Stage 4: gpu-03 falls off the bus (XID 79); drained and excluded")
    process.run([str(DEVCLUSTER / "set-node-state"), SICK_NODE, "xid79"], timeout=60, check=True)
    say("gpu-03's fixture now shows XID 79 (deploy/devcluster/set-node-state gpu-03 xid79)")
    run = submit(medic, FAULTY_NODE, "stage 4, plain DDP on 3 nodes")
    try:
        proposal = report_diagnosis(medic, run)
    except StageFailed as error:
        # The fixtures are the cluster's, shared with whoever else uses it.
        fixture = DEVCLUSTER_STATE / "nodes" / SICK_NODE / "fixture" / "emulation.json"
        shown = fixture.read_text().strip() if fixture.exists() else "healthy (no emulation.json)"
        raise StageFailed(f"{error}; {SICK_NODE}'s run fixture is now {shown}") from error
    if proposal.remediator != "drain_and_exclude":
        raise StageFailed(f"faulty node: expected drain_and_exclude, got {proposal.remediator}")
    verified = report_verified(medic, run)
    state, reason = node_reason(SICK_NODE)
    say(f"Slurm: {SICK_NODE} is {state.lower()}, reason [bold]{escape(reason)}[/bold]")
    if "DRAIN" not in state:
        raise StageFailed(f"{SICK_NODE} is {state}, not drained")
    nodes = node_list(verified.relaunch_job_id or 0)
    say(f"the relaunch ran on {', '.join(nodes)}: {SICK_NODE} excluded")
    if SICK_NODE in nodes:
        raise StageFailed(f"the relaunch ran on {SICK_NODE}")
    return StageTime("4 faulty node (XID 79)", verified_after_s(medic, run, verified))


def finale(medic: Medic, lineage: int, times: Sequence[StageTime]) -> None:
    headline("slurm-medic history")
    console.print(escape(medic.cli("history").stdout), end="")
    headline(f"slurm-medic show L{lineage}")
    console.print(escape(medic.cli("show", f"L{lineage}").stdout), end="")
    headline("Each stage, from its first submission to its relaunch verified (the record)")
    for stage in times:
        detail(f"{stage.seconds:6.1f} s  {stage.name}")


def stop_daemon(medic: Medic) -> None:
    if not medic.alive():
        return
    status = medic.stop()
    say(f"daemon stopped with SIGTERM (exit {status})")
    medic.dispose()


def restore_nodes(medic: Medic) -> None:
    process.run([str(DEVCLUSTER / "set-node-state"), SICK_NODE, "healthy"], timeout=60)
    _state, reason = node_reason(SICK_NODE)
    if reason.startswith("medic:"):
        medic.cli("nodes", "resume", SICK_NODE)
    say(f"{SICK_NODE} restored: fixture healthy, medic's drain lifted (`slurm-medic nodes resume`)")


def cancel_leftovers() -> None:
    """A failed demo leaves no run of its own behind (a dead rank lingers for its timeout)."""
    names = ",".join(
        f"e2e-{scenario.name}"
        for scenario in (FRAGMENTATION, TRUE_OOM_STEP0, TRUE_OOM_MIDRUN, HOST_RAM, FAULTY_NODE)
    )
    queued = process.run(["squeue", "-h", "-u", USER, "-n", names, "-o", "%i"], timeout=30)
    jobs = queued.stdout.split()
    if jobs:
        process.run(["scancel", *jobs], timeout=30)
        say(f"cancelled the demo's leftover jobs: {', '.join(jobs)}")


if __name__ == "__main__":
    sys.exit(main())
