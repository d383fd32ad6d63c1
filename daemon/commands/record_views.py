"""The commands that read the record for people: status, history, show (a run or a node).

Each reads through the repository functions and prints a table or a story for a person or,
with `--json`, one JSON document for a script; either way every string from the record is
printed inertly (`terminal`). Apart from the commands that act (`people`: approve, reject,
pause, resume; `nodes`) because reading needs no authority or audit event.

What a person is shown follows the web's rule (`people.may_see`), for `sudo slurm-medic` runs
for the person who ran sudo: their own runs, approvals and failures, and the nodes' public facts
(polls, drains, checks); an admin (root itself, or a member of `policy.admin_groups`) sees
everything. Another's run is "not in the record", as if it did not exist, as the web's 404.

Exit codes: 0 done; 1 not in the record (or not the reader's to see), or a config that cannot
be read; 2 usage; 3 the reader's uid has no passwd entry; 4 the record cannot be used
(missing, unreachable, locked, corrupt, or at another schema).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from sqlalchemy.orm import Session

from daemon.commands import node_views, story
from daemon.commands.context import CommandContext, Render, record_options
from daemon.commands.people import Person, invoking_person, may_see
from daemon.diagnosis import FailureKind
from daemon.slurm.scontrol import validate_node_name
from daemon.store import awaited, control, node_records, queries
from daemon.store import repository as repo
from daemon.store.models import Incident, NodeEvent, Proposal

if TYPE_CHECKING:
    from daemon.config import Settings

_LINEAGE_REF = re.compile(r"[Ll](?:ineage)?[:/]?([0-9]{1,10})\Z")
_JOB_REF = re.compile(r"([0-9]{1,19})\Z")
_RELATIVE = re.compile(r"([0-9]{1,6})([mhdw])\Z")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}

Sees = Callable[[str | None], bool]  # whether the reader may see a run of this owner


def _everything(_owner: str | None) -> bool:
    return True


@dataclass(frozen=True)
class Viewer:
    """Who reads the record, and what they may see of it (`people.may_see`)."""

    person: Person
    settings: Settings

    @classmethod
    def invoking(cls, settings: Settings) -> Viewer:
        """The person behind this command (sudo's caller under sudo)."""
        return cls(invoking_person(), settings)

    def sees(self, owner: str | None) -> bool:
        return may_see(self.person, owner=owner, settings=self.settings)

    @property
    def only_owner(self) -> str | None:
        """None when they may see every run; else the one owner whose runs they see: theirs."""
        return None if self.sees(None) else self.person.name


def _noting(render: Render, viewer: Viewer) -> Render:
    """The rendering, then a line saying whose runs alone were shown, when not everyone's."""
    owner = viewer.only_owner
    if owner is None:
        return render

    def noted(console: Console, shown: Any) -> None:
        render(console, shown)
        console.print(f"(only the runs of {owner} are shown)", markup=False)

    return noted


@click.command("status")
@record_options
def status_command(config_path: str | None, database_url: str | None, as_json: bool) -> None:
    """The daemon's state: pause switch, last polls, active runs, approvals waiting, drains."""
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    viewer = Viewer.invoking(context.settings)
    with context.session(read_only=True) as session:
        document = visible_status(status_document(session, context.settings), viewer.sees)
    context.emit(document, _noting(_print_status, viewer))


def visible_status(document: Mapping[str, Any], sees: Sees) -> dict[str, Any]:
    """`status_document` cut to the runs and approvals the reader may see; the pause, the
    polls and the drains are the cluster's, shown to everyone."""
    return {
        **document,
        "active_lineages": [row for row in document["active_lineages"] if sees(row["owner"])],
        "pending_approvals": [row for row in document["pending_approvals"] if sees(row["owner"])],
        "records_in_flight": {
            **document["records_in_flight"],
            "awaited": [
                row for row in document["records_in_flight"]["awaited"] if sees(row["owner"])
            ],
        },
    }


def status_document(session: Session, settings: Settings) -> dict[str, Any]:
    """What `status --json` prints and the web's overview and `/api/status` start from."""
    flag = control.pause_flag(session)
    return {
        "paused": bool(flag and flag.value),
        "pause": None
        if flag is None
        else {
            "value": flag.value,
            "by": flag.set_by,
            "at": story.when(flag.set_at),
            "reason": flag.reason,
        },
        "dry_run": settings.policy.dry_run,
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
            pending_document(session, proposal) for proposal in queries.pending_approvals(session)
        ],
        "drains": [drain_document(event) for event in control.drains_in_force(session)],
        "records_in_flight": in_flight_document(session),
    }


def in_flight_document(session: Session) -> dict[str, Any]:
    """What accounting may still be missing: a cursor held at the start of a gap, and the
    managed jobs that have ended with no final record in accounting yet."""
    found = awaited.in_flight(session)
    return {
        "held": [
            {
                "watcher": cursor.name,
                "polled_until": story.when(cursor.polled_until),
                "since": story.when(cursor.held_since),
                "reason": cursor.held_reason,
            }
            for cursor in found.held
        ],
        "awaited": [
            {
                "job": row.slurm_job_id,
                "lineage": row.lineage_id,
                "owner": owner,
                "left_queue_at": story.when(row.left_queue_at),
                "looks": row.looks,
                "accounting": row.accounting,
            }
            for row, owner in found.awaited
        ],
    }


def pending_document(session: Session, proposal: Proposal) -> dict[str, Any]:
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
    _print_in_flight(console, document["records_in_flight"])
    _print_pending(console, document["pending_approvals"])
    print_drains(console, document["drains"])


def _print_in_flight(console: Console, in_flight: dict[str, Any]) -> None:
    for held in in_flight["held"]:
        console.print(
            f"records in flight: {held['watcher']} held at {held['polled_until']} since"
            f" {held['since']}: {held['reason']}",
            markup=False,
        )
    if in_flight["awaited"]:
        console.print(
            story.table(
                "ended, record not yet in accounting",
                ("job", "lineage", "owner", "left the queue", "looks", "accounting shows"),
                (
                    (
                        row["job"],
                        row["lineage"],
                        row["owner"],
                        row["left_queue_at"],
                        row["looks"],
                        row["accounting"],
                    )
                    for row in in_flight["awaited"]
                ),
            )
        )


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
    viewer = Viewer.invoking(context.settings)
    owner = viewer.only_owner
    with context.session(read_only=True) as session:
        if owner is not None and user not in (None, owner):  # another's: none, as on the web
            document: dict[str, Any] = {"since": story.when(since), "incidents": []}
        else:
            document = history_document(
                session,
                since=since,
                until=now + timedelta(seconds=1),
                kind=FailureKind(kind) if kind else None,
                user=owner or user,
                limit=limit,
            )
    context.emit(
        document,
        _noting(lambda console, shown: console.print(_history_table(shown["incidents"])), viewer),
    )


def history_document(
    session: Session,
    *,
    since: datetime,
    until: datetime,
    kind: FailureKind | None,
    user: str | None,
    limit: int,
) -> dict[str, Any]:
    """`history --json`'s document (for the web's API too): the incidents in [since, until),
    newest first, each with its proposals."""
    incidents = queries.find_incidents(
        session, since=since, until=until, kind=kind, user=user, limit=limit
    )
    proposals: dict[int, list[Proposal]] = {}
    for proposal in queries.proposals_for_incidents(
        session, incident_ids=[incident.id for incident in incidents]
    ):
        proposals.setdefault(proposal.incident_id, []).append(proposal)
    rows = [history_row(incident, proposals.get(incident.id, [])) for incident in incidents]
    return {"since": story.when(since), "incidents": rows}


def history_row(incident: Incident, proposals: Sequence[Proposal]) -> dict[str, Any]:
    """One incident of the history, with what was proposed for it (the CLI's and the web's)."""
    return {
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
            for proposal in proposals
        ],
    }


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
    viewer = Viewer.invoking(context.settings)
    with context.session(read_only=True) as session:
        shown = show_document(session, reference, sees=viewer.sees)
    context.emit(shown.document, shown.render)


@dataclass(frozen=True)
class Shown:
    """What `show REFERENCE` found: its document, and whether it is a node's story (else a
    run's) for the rendering."""

    document: dict[str, Any]
    is_node: bool

    @property
    def render(self) -> Render:
        return node_views.print_node_story if self.is_node else story.print_story


def show_document(session: Session, reference: str, *, sees: Sees = _everything) -> Shown:
    """`show --json`'s document (for the web's API too) for a lineage (`L12`), a job id or a
    node; click.BadParameter when it names none of them, click.ClickException when the
    record does not hold it, or holds it as a run the reader may not see (`sees`), which reads
    the same. A node's story keeps only the incidents of runs the reader may see."""
    lineage = _LINEAGE_REF.match(reference.strip())
    if lineage:
        missing = click.ClickException(f"no lineage {lineage.group(1)} in the record")
        try:
            document = story.lineage_document(session, lineage_id=int(lineage.group(1)))
        except repo.NotFound as error:
            raise missing from error
        if not sees(document_owner(document)):
            raise missing
        return Shown(document, is_node=False)
    if job := _JOB_REF.match(reference.strip()):
        found = story.job_document(session, slurm_job_id=int(job.group(1)))
        if found is None or not sees(document_owner(found)):
            raise click.ClickException(f"job {job.group(1)} is not in the record")
        return Shown(found, is_node=False)
    node = _node_name(reference.strip())
    node_story = node_records.node_story(session, node)
    document = visible_node_story(node_views.story_document(node_story), sees)
    if not document["story"]:
        raise click.ClickException(f"no node {node} in the record")
    return Shown(document, is_node=True)


def document_owner(document: Mapping[str, Any]) -> str | None:
    """Whose run a `show` document tells: the lineage's owner, else its one job's user."""
    lineage = document.get("lineage")
    if lineage is not None:
        owner: str | None = lineage["owner"]
        return owner
    attempts = document["attempts"]
    return attempts[0]["job"]["user"] if attempts else None


def visible_node_story(document: Mapping[str, Any], sees: Sees) -> dict[str, Any]:
    """A node's story without the incidents of others' runs: its checks, drains and resumes
    are the cluster's, as `sinfo` shows them to everyone."""
    entries = [
        entry for entry in document["story"] if entry["what"] != "incident" or sees(entry["user"])
    ]
    return {**document, "story": entries}


def _node_name(reference: str) -> str:
    try:
        return validate_node_name(reference)
    except ValueError as error:
        raise click.BadParameter(
            f"{reference!r} is neither a lineage (L12), a job id nor a node name",
            param_hint="REFERENCE",
        ) from error
