"""The story of a run as one JSON-ready document, and its rendering for people.

`show` and `history` build these documents from the record and print either the document
(`--json`, for scripts) or the rendering: both come from the same data, so what a script
reads is what a person reads. Every string from outside (job names, log lines, rationale)
is printed through `terminal.printable` (control characters, bidi overrides and zero-width
characters shown as escapes) and rich's escaping, never as markup.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from sqlalchemy.orm import Session

from daemon.commands.terminal import printable, printable_document
from daemon.evidence.records import OomReport
from daemon.planner import AttemptRecord
from daemon.store import queries
from daemon.store import repository as repo
from daemon.store.codec import CodecError
from daemon.store.models import Incident, Job, Lineage, Proposal, TemplateRevision
from daemon.store.states import ProposalState
from daemon.templates.revisions import knobs_to_json

Document = dict[str, Any]

_OOM_FIGURES = (
    ("requested", "requested_bytes"),
    ("total", "total_bytes"),
    ("free", "free_bytes"),
    ("allocated", "allocated_bytes"),
    ("reserved", "reserved_bytes"),
    ("reserved but unallocated", "reserved_unallocated_bytes"),
)


def when(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat(timespec="seconds")


def short(iso: str | None) -> str | None:
    """A table's time: minutes, UTC (the JSON keeps the whole ISO time)."""
    return None if iso is None else iso[:16].replace("T", " ")


def gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.2f} GiB"


# ---------------------------------------------------------------- documents


def lineage_document(session: Session, *, lineage_id: int) -> Document:
    """A lineage across its attempts: each job, its incidents, proposals, diffs and outcome."""
    history = queries.lineage_story(session, lineage_id=lineage_id)
    revisions = {revision.id: revision for revision in history.revisions}
    attempts = [
        _attempt_document(session, attempt.job, attempt.incidents, attempt.proposals, revisions)
        for attempt in history.attempts
    ]
    return {"lineage": _lineage_summary(history.lineage), "attempts": attempts}


def job_document(session: Session, *, slurm_job_id: int) -> Document | None:
    """The story of one Slurm job; the whole lineage's when the job belongs to one."""
    story = queries.job_story(session, slurm_job_id=slurm_job_id)
    if story is None:
        return None
    if story.job.lineage_id is not None:
        document = lineage_document(session, lineage_id=story.job.lineage_id)
        document["asked_for_job"] = slurm_job_id
        return document
    attempt = _attempt_document(session, story.job, story.incidents, story.proposals, {})
    return {"lineage": None, "asked_for_job": slurm_job_id, "attempts": [attempt]}


def _lineage_summary(lineage: Lineage) -> Document:
    return {
        "id": lineage.id,
        "name": lineage.name,
        "owner": lineage.owner,
        "template": lineage.template,
        "status": lineage.status,
        "attempts": lineage.attempts,
        "created_at": when(lineage.created_at),
        "updated_at": when(lineage.updated_at),
    }


def _attempt_document(
    session: Session,
    job: Job,
    incidents: Sequence[Incident],
    proposals: Sequence[Proposal],
    revisions: dict[int, TemplateRevision],
) -> Document:
    proposal_docs = [_proposal_document(session, proposal, revisions) for proposal in proposals]
    story = queries.job_story(session, slurm_job_id=job.slurm_job_id)
    return {
        "attempt": job.attempt,
        "job": job_summary(job),
        "record": [] if story is None else _job_events(story),
        "incidents": [incident_document(incident) for incident in incidents],
        "proposals": proposal_docs,
        "node_events": []
        if story is None
        else [
            {
                "node": event.node,
                "kind": event.kind,
                "by_medic": event.by_medic,
                "reason": event.reason,
                "at": when(event.occurred_at),
            }
            for event in story.node_events
        ],
        "outcome": _outcome(job, incidents, proposals),
    }


def _job_events(story: queries.JobStory) -> list[Document]:
    """What the daemon noted about the job itself (submitted for a lineage, handled how)."""
    return [
        {
            "at": when(event.at),
            "who": event.actor_name,
            "verb": event.verb,
            "details": {key: value for key, value in event.details.items() if key != "token"},
        }
        for event in story.audit
        if event.subject_type == "job"
    ]


def job_summary(job: Job) -> Document:
    return {
        "id": job.slurm_job_id,
        "name": job.name,
        "user": job.user_name,
        "state": job.state,
        "exit_code": job.exit_code,
        "nodes": [str(node) for node in job.nodes],
        "start": when(job.start_time),
        "end": when(job.end_time),
    }


def incident_document(incident: Incident) -> Document:
    """The evidence and the diagnosis with its reasons; an unreadable stored record says so."""
    document: Document = {
        "id": incident.id,
        "kind": incident.kind,
        "confidence": incident.confidence,
        "onset": incident.onset,
        "node": incident.node,
        "rank": incident.rank,
        "step": incident.step,
        "occurred_at": when(incident.occurred_at),
    }
    try:
        evidence, diagnosis = repo.incident_records(incident)
    except CodecError as error:
        document["unreadable"] = f"the stored evidence does not decode: {error}"
        return document
    document["phase"] = diagnosis.phase.value
    document["mid_run_cause"] = diagnosis.mid_run_cause.value if diagnosis.mid_run_cause else None
    document["reasons"] = list(diagnosis.reasons)
    document["bad_nodes"] = list(diagnosis.bad_nodes)
    oom = diagnosis.oom or evidence.log.oom
    document["oom"] = _oom_document(oom) if oom is not None else None
    document["root_failure_line"] = evidence.log.root_failure_line
    document["log_notes"] = list(evidence.log.notes)
    probe = evidence.probe
    document["probe"] = (
        None
        if probe is None
        else {
            "node": probe.node,
            "verdict": probe.verdict.value,
            "reasons": list(probe.reasons),
            "xid": [event.code for event in probe.xid_events],
            "error": probe.error,
        }
    )
    return document


def _oom_document(oom: OomReport) -> Document:
    figures = {label: getattr(oom, attribute) for label, attribute in _OOM_FIGURES}
    return {"family": oom.family.value, "message": oom.message, "bytes": figures}


def _proposal_document(
    session: Session, proposal: Proposal, revisions: dict[int, TemplateRevision]
) -> Document:
    trail = [
        {
            "at": when(event.at),
            "who": event.actor_name,
            "actor_kind": event.actor_kind,
            "uid": event.actor_uid,
            "verb": event.verb,
            "reason": str(event.details.get("reason", "")),
        }
        for event in queries.proposal_audit_trail(session, proposal_id=proposal.id)
    ]
    revision = next((r for r in revisions.values() if r.proposal_id == proposal.id), None)
    document: Document = {
        "id": proposal.id,
        "remediator": proposal.remediator,
        "lever": proposal.lever,
        "rung": proposal.rung,
        "rationale": proposal.rationale,
        "changes_science": proposal.changes_science,
        "state": proposal.state,
        "decided_by": proposal.decided_by,
        "relaunch_job_id": proposal.relaunch_job_id,
        "trail": trail,
        "revision": None if revision is None else revision.id,
        "diff": "" if revision is None else _revision_diff(revision, revisions),
    }
    try:
        record = repo.attempt_record(proposal)
    except CodecError as error:
        document["unreadable"] = f"the stored proposal does not decode: {error}"
        return {**document, **_attempt_fields(None)}
    return {**document, **_attempt_fields(record)}


def _attempt_fields(record: AttemptRecord | None) -> Document:
    """What the planner remembers of the proposal: its knob moves, what it expects, the rungs
    passed over, where its relaunch resumed and how far it got; empty when unreadable."""
    if record is None:
        return {
            "changes": [],
            "expected_effect": None,
            "skipped_rungs": [],
            "failing_step": None,
            "resumed_step": None,
            "outcome": None,
            "step_reached": None,
        }
    fix = record.fix
    return {
        "changes": [
            {"knob": change.knob, **knobs_to_json({"before": change.before, "after": change.after})}
            for change in fix.patch.changes
        ],
        "expected_effect": fix.expected_effect,
        "skipped_rungs": [
            {"rung": skip.rung, "remediator": skip.remediator, "reason": skip.reason}
            for skip in fix.skipped
        ],
        "failing_step": fix.failing_step,
        "resumed_step": record.resumed_step,
        "outcome": record.outcome.value,
        "step_reached": record.step_reached,
    }


def _revision_diff(revision: TemplateRevision, revisions: dict[int, TemplateRevision]) -> str:
    parent = revisions.get(revision.parent_id) if revision.parent_id is not None else None
    before = parent.rendered_script if parent is not None else ""
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            revision.rendered_script.splitlines(keepends=True),
            fromfile=f"revision {parent.id}" if parent is not None else "(none)",
            tofile=f"revision {revision.id}",
        )
    )


def _outcome(job: Job, incidents: Sequence[Incident], proposals: Sequence[Proposal]) -> str:
    if not incidents:
        return f"{job.state}: no failure recorded"
    if not proposals:
        return f"{job.state}: diagnosed {incidents[-1].kind}; nothing proposed"
    last = proposals[-1]
    parts = [f"{job.state}: {last.remediator}"]
    if last.decided_by:
        verb = "rejected" if last.state == ProposalState.REJECTED.value else "approved"
        parts.append(f"{verb} by {last.decided_by}")
    if last.relaunch_job_id is not None:
        parts.append(f"relaunched as job {last.relaunch_job_id}")
    parts.append(f"now {last.state}")
    return ", ".join(parts)


# ---------------------------------------------------------------- rendering


def print_story(console: Console, document: Document) -> None:
    document = printable_document(document)
    lineage = document["lineage"]
    if lineage is not None:
        console.print(
            Text.assemble(
                (f"lineage {lineage['id']}", "bold"),
                f"  {lineage['name']}  owner {lineage['owner']}  template {lineage['template']}"
                f"  status {lineage['status']}  attempts {lineage['attempts']}",
            )
        )
    for attempt in document["attempts"]:
        console.print(_attempt_renderable(attempt))


def _attempt_renderable(attempt: Document) -> RenderableType:
    job = attempt["job"]
    parts: list[RenderableType] = [
        Text.assemble(
            (f"\nattempt {attempt['attempt'] or '-'}: job {job['id']}", "bold"),
            f"  {job['name']}  user {job['user']}  {job['state']}"
            f" (exit {job['exit_code']})  nodes {','.join(job['nodes']) or '-'}"
            f"  {job['start'] or '?'} .. {job['end'] or '?'}",
        )
    ]
    for event in attempt["record"]:
        details = ", ".join(f"{key} {value}" for key, value in event["details"].items())
        parts.append(Text(f"  {event['at']} {event['verb']} by {event['who']}: {details}"))
    for incident in attempt["incidents"]:
        parts.extend(_incident_lines(incident))
    for proposal in attempt["proposals"]:
        parts.extend(_proposal_lines(proposal))
    for event in attempt["node_events"]:
        who = "slurm-medic" if event["by_medic"] else "someone else"
        line = f"  node {event['node']} {event['kind']} by {who} at {event['at']}"
        parts.append(Text(f"{line}: {event['reason']}"))
    parts.append(Text(f"  outcome: {attempt['outcome']}", style="bold"))
    return Group(*parts)


def _incident_lines(incident: Document) -> Iterable[RenderableType]:
    yield Text(
        f"  diagnosis: {incident['kind']} ({incident['confidence']} confidence)"
        f" onset {incident['onset'] or '-'}  rank {incident['rank']}  node {incident['node']}"
        f"  step {incident['step']}  phase {incident.get('phase', '?')}"
    )
    if "unreadable" in incident:
        yield Text(f"    {incident['unreadable']}")
        return
    for reason in incident["reasons"]:
        yield Text(f"    because: {reason}")
    oom = incident["oom"]
    if oom is not None:
        yield Text(f"  evidence: {oom['family']}: {oom['message']}")
        figures = ", ".join(
            f"{label} {gib(value)}" for label, value in oom["bytes"].items() if value is not None
        )
        if figures:
            yield Text(f"    {figures}")
    probe = incident["probe"]
    if probe is not None:
        yield Text(f"  node probe {probe['node']}: {probe['verdict']}")
        for reason in probe["reasons"]:
            yield Text(f"    {reason}")
    for note in incident["log_notes"]:
        yield Text(f"  log: {note}")


def _proposal_lines(proposal: Document) -> Iterable[RenderableType]:
    science = "changes the science" if proposal["changes_science"] else "science unchanged"
    yield Text(
        f"  proposal {proposal['id']}: {proposal['remediator']} [{proposal['state']}] ({science})"
    )
    yield Text(f"    why: {proposal['rationale']}")
    if "unreadable" in proposal:
        yield Text(f"    {proposal['unreadable']}")
    for change in proposal["changes"]:
        yield Text(f"    {change['knob']}: {change['before']!r} -> {change['after']!r}")
    if proposal["expected_effect"]:
        yield Text(f"    expected: {proposal['expected_effect']}")
    for skipped in proposal["skipped_rungs"]:
        yield Text(f"    skipped {skipped.get('remediator')}: {skipped.get('reason')}")
    if proposal["resumed_step"] is not None:
        yield Text(f"    resumed from the checkpoint at step {proposal['resumed_step']}")
    if proposal["outcome"] not in (None, "pending"):
        yield Text(
            f"    relaunch judged {proposal['outcome']}: furthest step"
            f" {proposal['step_reached']} (it failed at step {proposal['failing_step']})"
        )
    for event in proposal["trail"]:
        reason = f": {event['reason']}" if event["reason"] else ""
        yield Text(f"    {event['at']} {event['verb']} by {event['who']}{reason}")
    if proposal["diff"]:
        yield Text("    diff applied:")
        yield Text("\n".join(f"      {line}" for line in proposal["diff"].splitlines()))


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> Table:
    """A table of plain text cells: markup or an escape sequence in a job name is shown,
    never interpreted."""
    result = Table(title=title, title_justify="left")
    for column in columns:
        result.add_column(column)
    for row in rows:
        result.add_row(*(escape(printable("-" if cell is None else str(cell))) for cell in row))
    return result
