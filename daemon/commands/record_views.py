"""The commands that read the record for people: status, history, show (a run or a node).

Each reads through the repository functions and prints a table or a story for a person or,
with `--json`, one JSON document for a script; either way every string from the record is
printed inertly (`terminal`). Apart from the commands that act (`people`: approve, reject,
pause, resume; `nodes`) because reading needs no identity, authority or audit event.

Exit codes: 0 done; 1 not in the record, or a config that cannot be read; 2 usage; 4 the
record cannot be used (missing, unreachable, locked, corrupt, or at another schema).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from rich.console import Console
from sqlalchemy.orm import Session

from daemon.commands import node_views, story
from daemon.commands.context import CommandContext, record_options
from daemon.diagnosis import FailureKind
from daemon.slurm.scontrol import validate_node_name
from daemon.store import control, node_records, queries
from daemon.store import repository as repo
from daemon.store.models import Incident, NodeEvent, Proposal

_LINEAGE_REF = re.compile(r"[Ll](?:ineage)?[:/]?([0-9]{1,10})\Z")
_JOB_REF = re.compile(r"([0-9]{1,19})\Z")
_RELATIVE = re.compile(r"([0-9]{1,6})([mhdw])\Z")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


@click.command("status")
@record_options
def status_command(config_path: str | None, database_url: str | None, as_json: bool) -> None:
    """The daemon's state: pause switch, last polls, active runs, approvals waiting, drains."""
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    with context.session(read_only=True) as session:
        flag = control.pause_flag(session)
        document = {
            "paused": bool(flag and flag.value),
            "pause": None
            if flag is None
            else {
                "value": flag.value,
                "by": flag.set_by,
                "at": story.when(flag.set_at),
                "reason": flag.reason,
            },
            "dry_run": context.settings.policy.dry_run,
            "polls": [
                {"watcher": cursor.name, "polled_until": story.when(cursor.polled_until)}
                for cursor in control.cursors(session)
            ],
            "active_lineages": [
                {
                    "id": lineage.id,
                    "name": lineage.name,
                    "owner": lineage.owner,
                    "attempts": lineage.attempts,
                    "updated_at": story.when(lineage.updated_at),
                }
                for lineage in queries.active_lineages(session)
            ],
            "pending_approvals": [
                _pending_document(session, proposal)
                for proposal in queries.pending_approvals(session)
            ],
            "drains": [drain_document(event) for event in control.drains_in_force(session)],
        }
    context.emit(document, _print_status)


def _pending_document(session: Session, proposal: Proposal) -> dict[str, Any]:
    incident = session.get(Incident, proposal.incident_id)
    return {
        "id": proposal.id,
        "lineage": proposal.lineage_id,
        "job": incident.slurm_job_id if incident else None,
        "owner": incident.user_name if incident else None,
        "kind": incident.kind if incident else None,
        "remediator": proposal.remediator,
        "changes_science": proposal.changes_science,
        "rationale": proposal.rationale,
        "created_at": story.when(proposal.created_at),
    }


def drain_document(event: NodeEvent) -> dict[str, Any]:
    return {
        "node": event.node,
        "reason": event.reason,
        "at": story.when(event.occurred_at),
        "incident": event.incident_id,
        "by": event.actor_name,
        "finding": event.finding,
        "check": event.check_id,
    }


def _print_status(console: Console, document: dict[str, Any]) -> None:
    pause = document["pause"]
    if document["paused"]:
        console.print(f"PAUSED by {pause['by']} at {pause['at']}: {pause['reason']}", markup=False)
    else:
        console.print("running (not paused)" + ("; dry run" if document["dry_run"] else ""))
    console.print(
        story.table(
            "last polls",
            ("watcher", "polled until"),
            ((poll["watcher"], poll["polled_until"]) for poll in document["polls"]),
        )
    )
    console.print(
        story.table(
            "active runs",
            ("lineage", "name", "owner", "attempts", "updated"),
            (
                (row["id"], row["name"], row["owner"], row["attempts"], row["updated_at"])
                for row in document["active_lineages"]
            ),
        )
    )
    _print_pending(console, document["pending_approvals"])
    print_drains(console, document["drains"])


def _print_pending(console: Console, pending: list[dict[str, Any]]) -> None:
    console.print(
        story.table(
            "waiting for approval",
            ("proposal", "job", "owner", "kind", "lever", "science", "why"),
            (
                (
                    row["id"],
                    row["job"],
                    row["owner"],
                    row["kind"],
                    row["remediator"],
                    "changes" if row["changes_science"] else "kept",
                    row["rationale"],
                )
                for row in pending
            ),
        )
    )


def print_drains(console: Console, drains: list[dict[str, Any]]) -> None:
    console.print(
        story.table(
            "nodes drained by slurm-medic",
            ("node", "since", "reason", "incident"),
            ((row["node"], row["at"], row["reason"], row["incident"]) for row in drains),
        )
    )


def parse_since(text: str, now: datetime) -> datetime:
    """`7d`, `12h`, `30m`, `2w` before now, or an ISO date/time (UTC when it names no zone)."""
    relative = _RELATIVE.match(text.strip())
    if relative:
        return now - timedelta(**{_UNITS[relative.group(2)]: int(relative.group(1))})
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise click.BadParameter(
            f"{text!r} is neither a duration like 7d/12h/30m nor an ISO date", param_hint="--since"
        ) from error
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@click.command("history")
@click.option("--user", default=None, help="Only this user's jobs.")
@click.option("--since", "since_text", default="7d", show_default=True, help="7d, 12h, or a date.")
@click.option("--kind", type=click.Choice([kind.value for kind in FailureKind]), default=None)
@click.option("--limit", type=click.IntRange(1, 10_000), default=200, show_default=True)
@record_options
def history_command(
    *,
    user: str | None,
    since_text: str,
    kind: str | None,
    limit: int,
    config_path: str | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Failures slurm-medic analysed, newest first, with what was proposed for each."""
    now = datetime.now(UTC)
    since = parse_since(since_text, now)
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    with context.session(read_only=True) as session:
        incidents = queries.find_incidents(
            session,
            since=since,
            until=now + timedelta(seconds=1),
            kind=FailureKind(kind) if kind else None,
            user=user,
            limit=limit,
        )
        proposals: dict[int, list[Proposal]] = {}
        for proposal in queries.proposals_for_incidents(
            session, incident_ids=[incident.id for incident in incidents]
        ):
            proposals.setdefault(proposal.incident_id, []).append(proposal)
        rows = [
            {
                "incident": incident.id,
                "at": story.when(incident.occurred_at),
                "job": incident.slurm_job_id,
                "lineage": incident.lineage_id,
                "user": incident.user_name,
                "kind": incident.kind,
                "confidence": incident.confidence,
                "node": incident.node,
                "step": incident.step,
                "proposals": [
                    {
                        "id": proposal.id,
                        "remediator": proposal.remediator,
                        "state": proposal.state,
                        "decided_by": proposal.decided_by,
                        "relaunch_job_id": proposal.relaunch_job_id,
                    }
                    for proposal in proposals.get(incident.id, [])
                ],
            }
            for incident in incidents
        ]
    document = {"since": story.when(since), "incidents": rows}
    context.emit(
        document,
        lambda console, shown: console.print(_history_table(shown["incidents"])),
    )


def _history_table(rows: list[dict[str, Any]]) -> Any:
    return story.table(
        "failures",
        ("when", "job", "lineage", "user", "kind", "confidence", "node", "step", "proposed"),
        (
            (
                story.short(row["at"]),
                row["job"],
                row["lineage"],
                row["user"],
                row["kind"],
                row["confidence"],
                row["node"],
                row["step"],
                "; ".join(f"{p['id']} {p['remediator']} {p['state']}" for p in row["proposals"]),
            )
            for row in rows
        ),
    )


@click.command("show")
@click.argument("reference", metavar="LINEAGE|JOB|NODE")
@record_options
def show_command(
    reference: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """The whole story of a run: `L12` for lineage 12, or a Slurm job id (its lineage's story);
    or of a node, by its name.

    A run's: each attempt, the evidence, the diagnosis and its reasons, the proposal and the
    diff that was applied, who decided and why, and the outcome. A node's: each check, drain
    and resume (who, why, on what finding) and each incident whose failing node it was.
    """
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    with context.session(read_only=True) as session:
        lineage = _LINEAGE_REF.match(reference.strip())
        if lineage:
            try:
                document = story.lineage_document(session, lineage_id=int(lineage.group(1)))
            except repo.NotFound as error:
                raise click.ClickException(
                    f"no lineage {lineage.group(1)} in the record"
                ) from error
        elif job := _JOB_REF.match(reference.strip()):
            found = story.job_document(session, slurm_job_id=int(job.group(1)))
            if found is None:
                raise click.ClickException(f"job {job.group(1)} is not in the record")
            document = found
        else:
            node = _node_name(reference.strip())
            node_story = node_records.node_story(session, node)
            if node_views.is_empty(node_story):
                raise click.ClickException(f"no node {node} in the record")
            context.emit(node_views.story_document(node_story), node_views.print_node_story)
            return
    context.emit(document, story.print_story)


def _node_name(reference: str) -> str:
    try:
        return validate_node_name(reference)
    except ValueError as error:
        raise click.BadParameter(
            f"{reference!r} is neither a lineage (L12), a job id nor a node name",
            param_hint="REFERENCE",
        ) from error
