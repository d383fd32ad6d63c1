"""`make demo`: slurm-medic closing the loop on the local cluster, three stages, a few minutes.

Brings the cluster up, prepares a fresh record, starts `slurm-medic run`, then, as alice:
a run that dies of fragmentation is fixed and relaunched without a person; a true OOM
waits for approval and alice approves it through the CLI; a faulty node (gpu-03, XID 79) is
drained and excluded. It ends with `history` and `show` for one lineage, stops the daemon
with SIGTERM and leaves the cluster up. Exits 1 with the reason when a stage misses its
expected outcome. The training program is an emulation (no GPU here): it says so itself.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the end-to-end harness lives beside the tests

from daemon import process  # noqa: E402
from daemon.store.models import Incident, Proposal  # noqa: E402
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
STAGE_TIMEOUT_S = 150
FRAGMENTATION = Scenario("demo-fragmentation", "torchrun", "fragmentation", nccl_timeout_s=3)
TRUE_OOM = Scenario(
    "demo-true-oom",
    "torchrun",
    "true-oom-step0",
    {"micro_batch": "6", "grad_accum": "4"},
    nccl_timeout_s=3,
)
FAULTY_NODE = Scenario(
    "demo-faulty-node",
    "torchrun",
    "faulty-node",
    {"nodes": "3"},
    one_rank_per_node=True,
    nccl_timeout_s=3,
)

console = Console(highlight=False)


@dataclass
class Clock:
    """Seconds since the demo started, printed beside what the daemon did."""

    started: float

    def __call__(self) -> str:
        return f"[dim]{time.monotonic() - self.started:6.1f}s[/dim]"


clock = Clock(time.monotonic())


def main() -> int:
    console.print(
        Panel(
            "slurm-medic on a real 4-node Slurm cluster (network namespaces on this machine).\n"
            "The training program is an emulation: no GPU is used; memory figures are "
            "modelled, the OOM messages, logs and checkpoints are real formats.",
            title="slurm-medic demo",
        )
    )
    bring_up_cluster()
    medic = start_daemon()
    try:
        fragmentation = stage_fragmentation(medic)
        stage_true_oom(medic)
        stage_faulty_node(medic)
        finale(medic, fragmentation)
    except StageFailed as error:
        console.print(f"\n[bold red]demo failed:[/bold red] {escape(str(error))}")
        console.print(f"daemon log: {medic.daemon_log}")
        return 1
    finally:
        stop_daemon(medic)
        restore_nodes(medic)
    console.print(
        "\n[bold green]demo complete.[/bold green] The cluster is still up "
        "(`deploy/devcluster/status`); take it down with `make cluster-down` "
        f"(deploy/devcluster/down). The demo's record and logs are in {STATE_DIR}."
    )
    return 0


def headline(text: str) -> None:
    console.print(f"\n[bold cyan]== {text}[/bold cyan]")


def say(text: str) -> None:
    console.print(f"{clock()}  {text}")


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
    )
    medic.prepare()
    medic.start()
    say(f"config {medic.config}: poll every {medic.poll_interval_s:g} s, record {medic.database}")
    say(
        "the epilog hook is not wired in the dev cluster's slurm.conf: the daemon finds "
        "ended jobs by polling sacct"
    )
    return medic


def submit(medic: Medic, scenario: Scenario) -> tuple[int, int]:
    lineage, job, token = medic.submit(make_template(STATE_DIR, scenario))
    say(
        f"alice's run submitted with `slurm-medic submit`: lineage L{lineage}, "
        f"Slurm job {job} (token {token} in its comment)"
    )
    return lineage, job


def wait(medic: Medic, what: str, probe: Callable[[], object]) -> None:
    medic.wait_for(what, probe, STAGE_TIMEOUT_S)


def report_diagnosis(medic: Medic, lineage: int, first_job: int) -> Proposal:
    wait(medic, f"L{lineage}: a diagnosis and a proposal", lambda: medic.proposals(lineage))
    incident: Incident = medic.incidents(lineage)[0]
    with medic.session() as session:
        diagnosis = session.get(Incident, incident.id)
        reasons = list(diagnosis.diagnosis.get("reasons", [])) if diagnosis else []
    say(
        f"job {first_job} ended; diagnosed [bold]{incident.kind}[/bold] "
        f"({incident.confidence} confidence) on {incident.node}, rank {incident.rank}"
    )
    for reason in reasons:
        console.print(f"           because: {escape(str(reason))}")
    proposal = medic.proposals(lineage)[0]
    say(f"proposed [bold]{proposal.remediator}[/bold]: {escape(proposal.rationale)}")
    return proposal


def report_verified(medic: Medic, lineage: int) -> Proposal:
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
    resumed = [line for line in log.splitlines() if "resumed from checkpoint" in line]
    say(f"relaunched as job {relaunch} (approved by {proposal.decided_by})")
    if resumed:
        say(f"relaunch log: {escape(resumed[0])}")
    say(f"[bold green]verified[/bold green]: {escape(log.strip().splitlines()[-1])}")
    return proposal


def stage_fragmentation(medic: Medic) -> int:
    headline("Stage 1: a run dies of fragmentation; the allocator fix is applied on its own")
    lineage, job = submit(medic, FRAGMENTATION)
    proposal = report_diagnosis(medic, lineage, job)
    if proposal.remediator != "allocator_expandable_segments":
        raise StageFailed(f"fragmentation: expected expandable segments, got {proposal.remediator}")
    wait(
        medic,
        "auto-approval",
        lambda: medic.proposal_in(lineage, ("submitted", "verifying", "verified")),
    )
    say("policy approved it (allocator env is in policy.auto_approve; the science is unchanged)")
    report_verified(medic, lineage)
    return lineage


def stage_true_oom(medic: Medic) -> None:
    headline("Stage 2: a true OOM; the batch change waits for a person, alice approves it")
    lineage, job = submit(medic, TRUE_OOM)
    proposal = report_diagnosis(medic, lineage, job)
    if proposal.remediator != "micro_batch_down" or proposal.state != "proposed":
        raise StageFailed(
            f"true OOM: expected micro_batch_down waiting, got {proposal.remediator} "
            f"{proposal.state}"
        )
    time.sleep(1)
    if medic.proposals(lineage)[0].state != "proposed":
        raise StageFailed("true OOM: the batch change did not wait for a person")
    say("waiting for a person: micro_batch_down is not in policy.auto_approve")
    approve = [
        "approve",
        str(proposal.id),
        "--comment",
        "halve the micro-batch, keep the global batch",
    ]
    done = medic.cli(*approve, as_user=USER)
    answer = escape(done.stdout.strip())
    say(f"alice: sudo slurm-medic approve {proposal.id} --comment '...' -> {answer}")
    story = medic.cli("show", f"L{lineage}").stdout
    for line in story.splitlines():
        if line.strip().startswith(
            (
                "-export MICRO_BATCH",
                "+export MICRO_BATCH",
                "-export GRAD_ACCUM",
                "+export GRAD_ACCUM",
            )
        ):
            console.print(f"           diff: {escape(line.strip())}")
    report_verified(medic, lineage)


def stage_faulty_node(medic: Medic) -> None:
    headline("Stage 3: gpu-03 falls off the bus (XID 79); drained and excluded")
    process.run([str(DEVCLUSTER / "set-node-state"), SICK_NODE, "xid79"], timeout=60, check=True)
    say("gpu-03's fixture now shows XID 79 (deploy/devcluster/set-node-state gpu-03 xid79)")
    lineage, job = submit(medic, FAULTY_NODE)
    proposal = report_diagnosis(medic, lineage, job)
    if proposal.remediator != "drain_and_exclude":
        raise StageFailed(f"faulty node: expected drain_and_exclude, got {proposal.remediator}")
    verified = report_verified(medic, lineage)
    state, reason = node_reason(SICK_NODE)
    say(f"Slurm: {SICK_NODE} is {state.lower()}, reason [bold]{escape(reason)}[/bold]")
    if "DRAIN" not in state:
        raise StageFailed(f"{SICK_NODE} is {state}, not drained")
    nodes = node_list(verified.relaunch_job_id or 0)
    say(f"the relaunch ran on {', '.join(nodes)}: {SICK_NODE} excluded")
    if SICK_NODE in nodes:
        raise StageFailed(f"the relaunch ran on {SICK_NODE}")


def finale(medic: Medic, lineage: int) -> None:
    headline("slurm-medic history")
    console.print(escape(medic.cli("history").stdout), end="")
    headline(f"slurm-medic show L{lineage}")
    console.print(escape(medic.cli("show", f"L{lineage}").stdout), end="")


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


if __name__ == "__main__":
    sys.exit(main())
