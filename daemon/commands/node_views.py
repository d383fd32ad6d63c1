"""A node as the record tells it, for `nodes` and `show NODE`: its checks, drains, resumes and
the incidents whose failing node it was, as JSON-ready documents and their rendering.

Both commands build the same documents, so a script reads what a person reads; every string
from the record (a deciding fact quotes the node's kernel log, a reason quotes a person) is
printed through `terminal.printable` and rich's escaping, never as markup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from daemon.commands import story
from daemon.store.models import Incident, NodeCheck, NodeEvent
from daemon.store.node_records import NodeStory

Document = dict[str, Any]

# Wide enough for any row: a table piped to a file or a program keeps one line per node.
PIPED_WIDTH = 100_000
# Within one second a node's incident comes before the check it caused, and a check before
# the drain or resume it decided.
_ORDER = {"incident": 0, "check": 1, "drain": 2, "resume": 2}


def decision_text(decision: str, reason: str, done: str | None = None) -> str:
    """`held: would drain_now (...)`, and what was done about it when anything was."""
    text = f"{decision}: {reason}"
    return f"{text} -> {done}" if done else text


def check_document(check: NodeCheck) -> Document:
    return {
        "what": "check",
        "check": check.id,
        "at": story.when(check.checked_at),
        "trigger": check.trigger,
        "health": check.health,
        "deciding": check.deciding,
        "findings": check.findings,
        "gpus_seen": check.gpus_seen,
        "gpus_expected": check.gpus_expected,
        "running_jobs": check.running_jobs,
        "decision": check.decision,
        "decision_reason": check.decision_reason,
        "by": check.actor_name,
    }


def event_document(event: NodeEvent) -> Document:
    """A drain or resume: who (the daemon or the person), why, on what finding, the check."""
    return {
        "what": event.kind,
        "at": story.when(event.occurred_at),
        "reason": event.reason,
        "by": event.actor_name or ("slurm-medic" if event.by_medic else "someone else"),
        "by_medic": event.by_medic,
        "finding": event.finding,
        "check": event.check_id,
        "incident": event.incident_id,
    }


def _incident_document(incident: Incident) -> Document:
    return {
        "what": "incident",
        "incident": incident.id,
        "at": story.when(incident.occurred_at),
        "job": incident.slurm_job_id,
        "user": incident.user_name,
        "kind": incident.kind,
        "confidence": incident.confidence,
    }


def story_document(node_story: NodeStory) -> Document:
    """Every check, drain, resume and incident of the node, merged oldest first."""
    # Sorted on the record's own times: the documents' are cut to the second.
    timed: list[tuple[datetime, int, Document]] = [
        *((row.checked_at, _ORDER["check"], check_document(row)) for row in node_story.checks),
        *((row.occurred_at, _ORDER[row.kind], event_document(row)) for row in node_story.events),
        *(
            (row.occurred_at, _ORDER["incident"], _incident_document(row))
            for row in node_story.incidents
        ),
    ]
    timed.sort(key=lambda item: item[:2])
    return {"node": node_story.node, "story": [entry for _, _, entry in timed]}


def is_empty(node_story: NodeStory) -> bool:
    return not (node_story.checks or node_story.events or node_story.incidents)


def print_node_story(console: Console, document: Document) -> None:
    console.print(f"node {document['node']}", markup=False)
    for entry in document["story"]:
        console.print(f"  {_moment(entry['at'])}  {_story_line(entry)}", markup=False)


def _story_line(entry: Mapping[str, Any]) -> str:
    if entry["what"] == "check":
        return (
            f"check {entry['check']} ({entry['trigger']}, by {entry['by']}): {entry['health']}:"
            f" {entry['deciding']}; " + decision_text(entry["decision"], entry["decision_reason"])
        )
    if entry["what"] == "incident":
        return (
            f"incident {entry['incident']}: job {entry['job']} of {entry['user']} died,"
            f" {entry['kind']} ({entry['confidence']} confidence)"
        )
    finding = f" on {entry['finding']}" if entry["finding"] else ""
    check = f" (check {entry['check']})" if entry["check"] is not None else ""
    return f"{entry['what']} by {entry['by']}{finding}{check}: {entry['reason']}"


def _moment(iso: str | None) -> str:
    return "?" if iso is None else iso[:19].replace("T", " ")


def node_rows(
    known: Iterable[str], latest: Mapping[str, NodeCheck], in_force: Mapping[str, NodeEvent]
) -> list[Document]:
    """One row per node the record knows: its last check and the slurm-medic drain in force."""
    return [
        {
            "node": node,
            "last_check": check_document(latest[node]) if node in latest else None,
            "drain": event_document(in_force[node]) if node in in_force else None,
        }
        for node in sorted(set(known))
    ]


def print_unwrapped(console: Console, table: Table) -> None:
    """A table a terminal wraps to its width; piped, each row stays one line, so `grep gpu-02`
    finds the node with its facts (rich would wrap it to 80 columns)."""
    if not console.is_terminal:
        console.width = PIPED_WIDTH
    console.print(table)


def print_nodes(console: Console, rows: list[Document]) -> None:
    print_unwrapped(
        console,
        story.table(
            "nodes slurm-medic knows",
            ("node", "last check", "trigger", "health", "deciding fact", "decision", "drained"),
            (_node_cells(row) for row in rows),
        ),
    )


def _node_cells(row: Mapping[str, Any]) -> tuple[object, ...]:
    check, drain = row["last_check"], row["drain"]
    drained = None
    if drain is not None:
        finding = f", {drain['finding']}" if drain["finding"] else ""
        drained = f"{drain['reason']} (by {drain['by']} at {story.short(drain['at'])}{finding})"
    if check is None:
        return (row["node"], "never probed", None, None, None, None, drained)
    return (
        row["node"],
        story.short(check["at"]),
        check["trigger"],
        check["health"],
        check["deciding"],
        decision_text(check["decision"], check["decision_reason"]),
        drained,
    )
