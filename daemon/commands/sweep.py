"""`slurm-medic sweep [NODESET]`: probe many nodes now, judge each for the fleet, print a table.

The admin's look at the fleet by the daemon's own rules (`daemon.fleet`): each check goes on the
record as the scheduled sweep's do, naming the person who asked. Without `--drain` nothing is
drained: a drain policy would make is recorded and shown held ("would drain_now ..."), so a
look never changes the cluster; with `--drain` policy drains, through the circuit breaker the
incidents and the daemon's sweeps share.

Slurm and the nodes are reached through `slurm_backend` and `node_prober`, the seams `nodes
drain` and `nodes resume` use too (and tests replace).

Exit codes (as `probe`): 0 every node healthy or degraded; 1 a node is faulty, or Slurm could
not be asked; 2 usage (a bad NODESET, no [probe] settings, an unsafe key); 3 not allowed, or a
node unreachable; 4 the record cannot be used.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from rich.console import Console

from daemon.commands import story
from daemon.commands.context import EXIT_REFUSED, CommandContext, record_options
from daemon.commands.node_views import decision_text, print_unwrapped
from daemon.commands.people import Person, invoking_person, require_admin_on_record
from daemon.config import Settings
from daemon.evidence.prober import NodeProber, ProbeSettings
from daemon.evidence.records import ProbeVerdict
from daemon.fleet.sweep import SweepDeps, SweepTarget, SweptNode, sweep, sweep_nodes
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import SlurmError, SlurmParseError
from daemon.slurm.hostlist import expand_hostlist
from daemon.ssh import UnsafeKey
from daemon.store.models import CheckTrigger

EXIT_FAULTY = 1
EXIT_UNREACHABLE = 3
EXIT_SLURM = 1


def slurm_backend(context: CommandContext) -> SlurmBackend:
    """Slurm as these commands reach it."""
    return context.slurm()


def node_prober(settings: ProbeSettings) -> NodeProber:
    """The nodes over SSH, as the daemon probes them."""
    return NodeProber(settings)


def parse_nodeset(text: str) -> tuple[str, ...]:
    """A Slurm hostlist (`gpu-[01-04]`) read the one bounded way; no node is a usage error."""
    try:
        nodes = expand_hostlist(text)
    except SlurmParseError as error:
        raise click.BadParameter(str(error), param_hint="NODESET") from error
    if not nodes:
        raise click.BadParameter(f"{text!r} names no node", param_hint="NODESET")
    return nodes


def fleet_deps(context: CommandContext, person: Person, backend: SlurmBackend) -> SweepDeps:
    """What a sweep run by `person` needs; the config's [probe] section says how to reach nodes."""
    probe = context.settings.probe
    if probe is None:
        raise context.fail(
            "probing nodes needs the config's [probe] section (key_path, known_hosts_path)",
            exit_code=EXIT_REFUSED,
        )
    try:
        prober = node_prober(probe)
    except UnsafeKey as error:
        raise context.fail(str(error), exit_code=EXIT_REFUSED) from error
    return SweepDeps(context.settings, backend, prober, lambda: datetime.now(UTC), person.actor)


def default_nodes(settings: Settings, backend: SlurmBackend) -> list[str]:
    """`sweep.nodes` when the config names them, else every node whose gres names GPUs."""
    if settings.sweep.nodes is not None:
        return sweep_nodes((), settings.sweep.nodes)
    return sweep_nodes(backend.nodes(), None)


@click.command("sweep")
@click.argument("nodeset", required=False)
@click.option(
    "--drain",
    is_flag=True,
    help="Drain what policy drains (within the circuit breaker); without it nothing is drained.",
)
@click.option(
    "--since-minutes",
    type=click.FloatRange(min=0),
    default=None,
    help="Kernel events of the last N minutes count (default: sweep.interval_s).",
)
@record_options
def sweep_command(
    *,
    nodeset: str | None,
    drain: bool,
    since_minutes: float | None,
    config_path: str | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Probe NODESET now (`gpu-[01-04]`; default sweep.nodes, else every GPU node) and judge
    each node: healthy, degraded, faulty or unreachable, with the fact that decides."""
    named = parse_nodeset(nodeset) if nodeset is not None else None
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    person = invoking_person()
    with context.session() as session:
        require_admin_on_record(
            session,
            person,
            context.settings,
            what="sweep nodes",
            verb="sweep_refused",
            subject=nodeset or "every GPU node",
            details={"drain": drain},
        )
        backend = slurm_backend(context)
        deps = fleet_deps(context, person, backend)
        window = (
            timedelta(minutes=since_minutes)
            if since_minutes is not None
            else timedelta(seconds=context.settings.sweep.interval_s)
        )
        try:
            nodes = named or default_nodes(context.settings, backend)
            if not nodes:
                raise context.fail(
                    "no node to sweep: Slurm lists no node whose gres names GPUs;"
                    " name a NODESET or set sweep.nodes",
                    exit_code=EXIT_SLURM,
                )
            start = deps.clock() - window
            targets = [SweepTarget(node, CheckTrigger.COMMAND, start) for node in nodes]
            swept = sweep(session, deps, targets, act=drain)
        except SlurmError as error:
            raise context.fail(
                f"Slurm could not be asked: {error}", exit_code=EXIT_SLURM
            ) from error
    context.emit(sweep_document(swept), _print_sweep)
    raise SystemExit(sweep_exit_code([row.judgement.health for row in swept]))


def sweep_exit_code(healths: Sequence[ProbeVerdict]) -> int:
    """1 if any node is faulty, else 3 if any is unreachable, else 0 (as `probe`)."""
    if ProbeVerdict.FAULTY in healths:
        return EXIT_FAULTY
    if ProbeVerdict.UNREACHABLE in healths:
        return EXIT_UNREACHABLE
    return 0


def swept_document(row: SweptNode) -> dict[str, Any]:
    judgement = row.judgement
    return {
        "node": judgement.node,
        "health": judgement.health.value,
        "deciding": judgement.deciding,
        "findings": [
            {
                "kind": finding.kind.value,
                "health": finding.health.value,
                "text": finding.text,
                "gpu": finding.gpu,
            }
            for finding in judgement.findings
        ],
        "gpus_seen": judgement.gpus_seen,
        "gpus_expected": judgement.gpus_expected,
        "running_jobs": list(judgement.running_jobs),
        "decision": row.decision.kind.value,
        "decision_reason": row.decision.reason,
        "done": row.done,
        "check": row.check_id,
    }


def sweep_document(swept: Sequence[SweptNode]) -> dict[str, Any]:
    counts = Counter(row.judgement.health for row in swept)
    return {
        "nodes": [swept_document(row) for row in swept],
        "summary": {health.value: counts[health] for health in ProbeVerdict},
    }


def summary_line(summary: dict[str, int]) -> str:
    return ", ".join(f"{summary[health.value]} {health.value}" for health in ProbeVerdict)


def _print_sweep(console: Console, document: dict[str, Any]) -> None:
    print_unwrapped(
        console,
        story.table(
            "fleet sweep",
            ("node", "health", "deciding fact", "decision"),
            (
                (
                    row["node"],
                    row["health"],
                    row["deciding"],
                    decision_text(row["decision"], row["decision_reason"], row["done"]),
                )
                for row in document["nodes"]
            ),
        ),
    )
    console.print(summary_line(document["summary"]), markup=False)
