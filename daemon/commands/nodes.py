"""`slurm-medic nodes`: the nodes slurm-medic knows, the admin's cordon, and a finding's history.

- `nodes`: every node on the record (checked, drained or resumed) with its last check and the
  slurm-medic drain in force; the JSON keeps its old `drains` list for existing scripts.
- `nodes drain NODESET --reason TEXT` and `nodes resume NODESET`: for root and members of
  `policy.admin_groups`, recorded like the daemon's own drains (who, why, the probe at that
  moment when the config has [probe] settings). A cordon's Slurm reason starts `medic:` and
  names the person; it never overwrites a drain someone else set, and it does not count
  against the circuit breaker, which bounds the daemon's drains.
- `nodes history --finding KIND`: which nodes showed KIND in a time range, when they were
  drained, and which jobs died on them before.

Exit codes: 0 done; 1 a node Slurm would not drain or resume (the others are done), Slurm
could not be asked, or a config that cannot be read; 2 usage (a bad NODESET, an unsafe
probe key); 3 not allowed, or no slurm-medic drain in force to resume; 4 the record cannot
be used.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from rich.console import Console
from sqlalchemy.orm import Session

from daemon.commands import story
from daemon.commands import sweep as fleet_commands
from daemon.commands.context import CommandContext, echo_lines, record_options
from daemon.commands.node_views import node_rows, print_nodes, print_unwrapped
from daemon.commands.people import NotAllowed, Person, invoking_person, require_admin_on_record
from daemon.commands.record_views import drain_document, print_drains
from daemon.evidence.records import FindingKind
from daemon.fleet.findings import CORDON_FINDING
from daemon.fleet.node_policy import slurm_reason
from daemon.fleet.sweep import SweepTarget, SweptNode, change_node, sweep
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import SlurmError
from daemon.store import control, node_records
from daemon.store import repository as repo
from daemon.store.models import CheckTrigger, NodeEventKind
from daemon.store.node_records import FindingHistory

EXIT_NOT_DONE = 1
HISTORY_DAYS = 30
NOT_PROBED = "not probed: no [probe] settings"


@click.group("nodes", invoke_without_command=True)
@record_options
@click.pass_context
def nodes_group(
    click_context: click.Context, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """Every node slurm-medic knows, its last probe and the drain in force; `nodes drain`,
    `nodes resume` and `nodes history` below."""
    if click_context.invoked_subcommand is not None:
        return
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    with context.session(read_only=True) as session:
        document = nodes_document(session)
    context.emit(document, _print_nodes_and_drains)


def nodes_document(session: Session) -> dict[str, Any]:
    """`nodes --json`'s document (for the web page too): every node on the record with its
    last check and the slurm-medic drain in force, and the drains alone."""
    latest = node_records.latest_checks(session)
    in_force = {event.node: event for event in control.drains_in_force(session)}
    known = {*latest, *in_force, *node_records.event_nodes(session)}
    return {
        "nodes": node_rows(known, latest, in_force),
        "drains": [drain_document(event) for event in in_force.values()],
    }


def _print_nodes_and_drains(console: Console, document: dict[str, Any]) -> None:
    print_nodes(console, document["nodes"])
    print_drains(console, document["drains"])


def _probe_now(
    session: Session,
    context: CommandContext,
    person: Person,
    backend: SlurmBackend,
    nodes: Sequence[str],
) -> dict[str, SweptNode]:
    """Each node's probe at this moment, on the record as a check by the person (nothing is
    drained by it); none when the config has no [probe] settings."""
    if context.settings.probe is None:
        return {}
    deps = fleet_commands.fleet_deps(context, person, backend)
    start = deps.clock() - timedelta(seconds=context.settings.sweep.interval_s)
    targets = [SweepTarget(node, CheckTrigger.CORDON, start) for node in nodes]
    try:
        swept = sweep(session, deps, targets, act=False)
    except SlurmError as error:
        raise context.fail(f"Slurm could not be asked: {error}", exit_code=EXIT_NOT_DONE) from error
    return {row.judgement.node: row for row in swept}


def _probe_document(swept: SweptNode | None) -> dict[str, Any]:
    if swept is None:
        return {"check": None, "health": None, "deciding": NOT_PROBED}
    judgement = swept.judgement
    return {
        "check": swept.check_id,
        "health": judgement.health.value,
        "deciding": judgement.deciding,
    }


def _node_line(row: dict[str, Any]) -> str:
    probe = (
        row["deciding"]
        if row["check"] is None
        else (f"probe {row['health']}: {row['deciding']} (check {row['check']})")
    )
    return f"{row['node']} {row['done']}; {probe}"


@nodes_group.command("drain")
@click.argument("nodeset")
@click.option("--reason", "why", required=True, help="Why, for the record and Slurm's reason.")
@record_options
def nodes_drain_command(
    nodeset: str, why: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """Cordon NODESET (`gpu-[01-04]`): drain it with a `medic:` reason that names you, the
    probe at that moment on the record (never over a drain someone else set)."""
    if not why.strip():
        raise click.BadParameter("say why", param_hint="--reason")
    nodes = fleet_commands.parse_nodeset(nodeset)
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    person = invoking_person()
    with context.session() as session:
        grounds = require_admin_on_record(
            session,
            person,
            context.settings,
            what="drain nodes",
            verb="node_drain_refused",
            subject=nodeset,
            details={"why": why},
        )
        backend = fleet_commands.slurm_backend(context)
        probes = _probe_now(session, context, person, backend, nodes)
        reason = slurm_reason(f"cordon by {person.name}: {why}")
        rows: list[dict[str, Any]] = []
        for node in nodes:
            probe = _probe_document(probes.get(node))
            done = change_node(
                session,
                backend,
                person.actor,
                node=node,
                kind=NodeEventKind.DRAIN,
                reason=reason,
                check_id=probe["check"],
                finding=CORDON_FINDING,
            )
            if done.error is None:
                repo.append_audit(
                    session,
                    actor=person.actor,
                    verb="node_drain",
                    subject_type="node",
                    subject_id=node,
                    details={"why": why, "grounds": grounds, "check": probe["check"]},
                )
                session.commit()
            outcome = "drained" if done.error is None else f"not drained: {done.error}"
            rows.append({"node": node, "done": outcome, "action": done.action.id, **probe})
    document = {"by": person.name, "grounds": grounds, "reason": reason, "nodes": rows}
    context.emit(document, echo_lines(lambda shown: (_node_line(row) for row in shown["nodes"])))
    if any(row["done"] != "drained" for row in rows):
        raise SystemExit(EXIT_NOT_DONE)


@nodes_group.command("resume")
@click.argument("nodeset")
@click.option("--why", default="", help="The reason, for the record.")
@record_options
def nodes_resume_command(
    nodeset: str, why: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """Return NODESET's nodes slurm-medic drained to service (never a drain someone else set)."""
    nodes = fleet_commands.parse_nodeset(nodeset)
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    person = invoking_person()
    with context.session() as session:
        document = resume_nodes(session, context, person, nodeset=nodeset, nodes=nodes, why=why)
    context.emit(document, echo_lines(lambda shown: (_node_line(row) for row in shown["nodes"])))
    if any(row["done"] != "resumed" for row in document["nodes"]):
        raise SystemExit(EXIT_NOT_DONE)


def resume_nodes(
    session: Session,
    context: CommandContext,
    person: Person,
    *,
    nodeset: str,
    nodes: Sequence[str],
    why: str,
) -> dict[str, Any]:
    """`nodes resume` for the CLI and the web page alike: an admin only (a refusal is on the
    record, then NotAllowed), only nodes with a slurm-medic drain in force, each probed and
    resumed through Slurm; the document says what was done to each."""
    require_admin_on_record(
        session,
        person,
        context.settings,
        what="resume a node",
        verb="node_resume_refused",
        subject=nodeset,
        details={"why": why},
    )
    in_force = {event.node for event in control.drains_in_force(session)}
    missing = [node for node in nodes if node not in in_force]
    if missing:
        raise NotAllowed(f"the record holds no slurm-medic drain of {', '.join(missing)} in force")
    backend = fleet_commands.slurm_backend(context)
    probes = _probe_now(session, context, person, backend, nodes)
    reason = f"resumed by {person.name}" + (f": {why}" if why else "")
    rows: list[dict[str, Any]] = []
    for node in nodes:
        probe = _probe_document(probes.get(node))
        done = change_node(
            session,
            backend,
            person.actor,
            node=node,
            kind=NodeEventKind.RESUME,
            reason=reason,
            check_id=probe["check"],
        )
        outcome = "resumed" if done.error is None else f"not resumed: {done.error}"
        rows.append({"node": node, "done": outcome, "action": done.action.id, **probe})
    return {"by": person.name, "reason": reason, "nodes": rows}


def _moment(text: str, hint: str) -> datetime:
    """An ISO date or time, UTC when it names no zone."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise click.BadParameter(f"{text!r} is not an ISO date or time", param_hint=hint) from error
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _history_document(history: FindingHistory) -> dict[str, Any]:
    return {
        "node": history.node,
        "first_seen": story.when(history.first_seen),
        "last_seen": story.when(history.last_seen),
        "checks": history.checks,
        "deciding": history.deciding,
        "drained_at": story.when(history.drained_at),
        "drain_reason": history.drain_reason,
        "jobs_died": [
            {
                "job": job.slurm_job_id,
                "user": job.user_name,
                "state": job.state,
                "end": story.when(job.end_time),
            }
            for job in history.jobs_died
        ],
    }


@nodes_group.command("history")
@click.option(
    "--finding",
    type=click.Choice([kind.value for kind in FindingKind]),
    required=True,
    help="The finding asked about, e.g. remap_pending.",
)
@click.option(
    "--since", "since_text", default=None, help="ISO date or time (default: 30 days ago)."
)
@click.option("--until", "until_text", default=None, help="ISO date or time (default: now).")
@record_options
def nodes_history_command(
    *,
    finding: str,
    since_text: str | None,
    until_text: str | None,
    config_path: str | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Which nodes showed a finding, when they were drained, and which jobs died on them before."""
    now = datetime.now(UTC)
    until = _moment(until_text, "--until") if until_text is not None else now
    since = (
        _moment(since_text, "--since")
        if since_text is not None
        else until - timedelta(days=HISTORY_DAYS)
    )
    if since > until:
        raise click.BadParameter("--since is after --until", param_hint="--since")
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    with context.session(read_only=True) as session:
        histories = node_records.finding_history(session, kind=finding, since=since, until=until)
        rows = [_history_document(history) for history in histories]
    document = {
        "finding": finding,
        "since": story.when(since),
        "until": story.when(until),
        "nodes": rows,
    }
    context.emit(document, _print_history)


def _print_history(console: Console, document: dict[str, Any]) -> None:
    print_unwrapped(
        console,
        story.table(
            f"nodes with {document['finding']} from {story.short(document['since'])}"
            f" to {story.short(document['until'])}",
            ("node", "first seen", "last seen", "checks", "drained", "jobs that died before"),
            (
                (
                    row["node"],
                    story.short(row["first_seen"]),
                    story.short(row["last_seen"]),
                    row["checks"],
                    None
                    if row["drained_at"] is None
                    else f"{story.short(row['drained_at'])}: {row['drain_reason']}",
                    "; ".join(
                        f"{job['job']} {job['user']} {job['state']} {story.short(job['end'])}"
                        for job in row["jobs_died"]
                    ),
                )
                for row in document["nodes"]
            ),
        ),
    )
