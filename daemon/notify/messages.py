"""What a person is told, decided from record facts alone (pure: no session, no I/O).

A message is lines of segments: our own words (`str`) and words someone else wrote
(`Untrusted`: job names, user names, reasons quoting logs, node names). The two renderings treat
the second kind differently: mail makes it one line of plain text (no CR/LF can reach a header
or forge a line), the webhook puts it in a code span with what Slack or Mattermost would parse
(`<`, `>`, `&`, backquotes, mentions) replaced, so a job named `<!channel>` or `[x](http://…)`
is shown, never obeyed.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from daemon.store.models import NotificationEvent

# One value someone else wrote, as shown: enough for a job name or a reason, bounded so a
# hostile one cannot fill a mailbox.
MAX_VALUE_CHARS = 300
SUBJECT_PREFIX = "[slurm-medic] "
MAX_SUBJECT_CHARS = 200
# Characters chat markdown acts on, replaced by look-alikes that it does not.
_WEBHOOK_LOOKALIKES = str.maketrans({"<": "\u2039", ">": "\u203a", "&": "\uff06", "`": "\u02cb"})
# Unicode categories that are not shown text: controls, format characters (bidi overrides,
# zero-width), line and paragraph separators, unassigned and surrogates.
_INVISIBLE = frozenset({"Cc", "Cf", "Cn", "Co", "Cs", "Zl", "Zp"})
_ZERO_WIDTH_SPACE = "\u200b"


@dataclass(frozen=True)
class Untrusted:
    """Text someone other than slurm-medic wrote."""

    text: str


Segment = str | Untrusted
Line = tuple[Segment, ...]


@dataclass(frozen=True)
class Message:
    """One event told: `owner` is the user it is for (None: the admins')."""

    event: NotificationEvent
    subject: str  # `proposal:12`, `lineage:3`, `node_event:9`
    owner: str | None
    title: Line
    lines: tuple[Line, ...]


@dataclass(frozen=True)
class JobFacts:
    """The failed job a message is about, as the record has it."""

    slurm_job_id: int
    name: str
    user: str
    kind: str
    lineage_id: int | None


@dataclass(frozen=True)
class WaitingApproval:
    proposal_id: int
    job: JobFacts
    remediator: str
    rung: int
    rationale: str
    changes_science: bool


@dataclass(frozen=True)
class RunGivenUp:
    lineage_id: int
    lineage_name: str
    owner: str
    status: str
    reason: str
    last_job: JobFacts | None


@dataclass(frozen=True)
class RunEscalated:
    """A relaunch that failed again (`verify`: outcome same_failure or different_failure)."""

    proposal_id: int
    job: JobFacts  # the failure the relaunch was meant to fix
    relaunch_job_id: int | None
    relaunch_kind: str | None  # what the relaunch died of, if it was diagnosed
    outcome: str
    failing_step: int | None
    step_reached: int | None
    reason: str


@dataclass(frozen=True)
class NodeDrained:
    node_event_id: int
    node: str
    reason: str
    finding: str | None
    slurm_job_id: int | None


Fact = WaitingApproval | RunGivenUp | RunEscalated | NodeDrained


def message_for(fact: Fact, *, web_url: str | None) -> Message:
    """The message for one fact; `web_url` adds a link to the web page."""
    match fact:
        case WaitingApproval():
            return _waiting(fact, web_url)
        case RunGivenUp():
            return _given_up(fact, web_url)
        case RunEscalated():
            return _escalated(fact, web_url)
        case NodeDrained():
            return _drained(fact, web_url)


def _job_line(job: JobFacts) -> Line:
    return (
        f"Job {job.slurm_job_id} ",
        Untrusted(job.name),
        " of ",
        Untrusted(job.user),
        " died: ",
        Untrusted(job.kind),
    )


def _link(web_url: str | None, path: str) -> tuple[Line, ...]:
    if web_url is None:
        return ()
    return ((f"On the web: {web_url.rstrip('/')}/{path}",),)


def _run_link(web_url: str | None, lineage_id: int | None) -> tuple[Line, ...]:
    return () if lineage_id is None else _link(web_url, f"runs/{lineage_id}")


def _waiting(fact: WaitingApproval, web_url: str | None) -> Message:
    science = "; it changes the science of the run" if fact.changes_science else ""
    number = fact.proposal_id
    return Message(
        event=NotificationEvent.APPROVAL_WAITING,
        subject=f"proposal:{number}",
        owner=fact.job.user,
        title=(
            f"job {fact.job.slurm_job_id} (",
            Untrusted(fact.job.name),
            f"): relaunch {number} waits for your approval",
        ),
        lines=(
            _job_line(fact.job),
            ("Proposed fix: ", Untrusted(fact.remediator), f" (rung {fact.rung}){science}"),
            ("Why: ", Untrusted(fact.rationale)),
            (f"Approve: slurm-medic approve {number} --comment '...'",),
            (f"Reject: slurm-medic reject {number} --why '...'",),
            *_link(web_url, "approvals"),
        ),
    )


def _given_up(fact: RunGivenUp, web_url: str | None) -> Message:
    last = (_job_line(fact.last_job),) if fact.last_job is not None else ()
    return Message(
        event=NotificationEvent.RUN_GIVEN_UP,
        subject=f"lineage:{fact.lineage_id}",
        owner=fact.owner,
        title=(f"run L{fact.lineage_id} (", Untrusted(fact.lineage_name), f") {fact.status}"),
        lines=(
            (
                f"slurm-medic stopped relaunching run L{fact.lineage_id} (",
                Untrusted(fact.lineage_name),
                ").",
            ),
            ("Why: ", Untrusted(fact.reason)),
            *last,
            (f"Its story: slurm-medic show L{fact.lineage_id}",),
            *_run_link(web_url, fact.lineage_id),
        ),
    )


def _escalated(fact: RunEscalated, web_url: str | None) -> Message:
    relaunch = f"relaunch {fact.relaunch_job_id}" if fact.relaunch_job_id else "the relaunch"
    if fact.outcome == "different_failure":
        next_move = "It failed differently: a person must decide what comes next."
    else:
        next_move = "It failed the same way: slurm-medic tries the next fix of the ladder."
    died_of: tuple[Line, ...] = ()
    if fact.relaunch_kind is not None:
        died_of = ((f"The {relaunch} died: ", Untrusted(fact.relaunch_kind)),)
    lineage = fact.job.lineage_id
    story: tuple[Line, ...] = ()
    if lineage is not None:
        story = ((f"Its story: slurm-medic show L{lineage}",),)
    return Message(
        event=NotificationEvent.RUN_ESCALATED,
        subject=f"proposal:{fact.proposal_id}",
        owner=fact.job.user,
        title=(
            f"job {fact.job.slurm_job_id} (",
            Untrusted(fact.job.name),
            f"): {relaunch} did not pass step {_step(fact.failing_step)}",
        ),
        lines=(
            _job_line(fact.job),
            (
                f"The {relaunch} of proposal {fact.proposal_id} reached step"
                f" {_step(fact.step_reached)}; it had to pass step {_step(fact.failing_step)}.",
            ),
            *died_of,
            (next_move,),
            ("Why: ", Untrusted(fact.reason)),
            *story,
            *_run_link(web_url, lineage),
        ),
    )


def _drained(fact: NodeDrained, web_url: str | None) -> Message:
    cause: tuple[Line, ...] = ()
    if fact.finding:
        cause = (("Finding: ", Untrusted(fact.finding)),)
    job: tuple[Line, ...] = ()
    if fact.slurm_job_id is not None:
        job = ((f"After job {fact.slurm_job_id} died on it.",),)
    link = _link(web_url, f"nodes/{fact.node}") if _is_plain_name(fact.node) else ()
    return Message(
        event=NotificationEvent.NODE_DRAINED,
        subject=f"node_event:{fact.node_event_id}",
        owner=None,
        title=("node ", Untrusted(fact.node), " drained by slurm-medic"),
        lines=(
            ("slurm-medic drained node ", Untrusted(fact.node), "."),
            ("Reason: ", Untrusted(fact.reason)),
            *cause,
            *job,
            ("Back to service, once fixed: slurm-medic nodes resume ", Untrusted(fact.node)),
            *link,
        ),
    )


def _step(step: int | None) -> str:
    return "?" if step is None else str(step)


def _is_plain_name(name: str) -> bool:
    """A node name that can go into a URL as it is (Slurm's names are; a hostile one is not)."""
    return (
        name[:1].isascii()
        and name[:1].isalnum()
        and all(c.isascii() and (c.isalnum() or c in "-_.") for c in name)
    )


# ----------------------------------------------------------------------------- rendering


def one_line(text: str) -> str:
    """Someone else's text as one line of shown characters, bounded: every control, format
    and separator character becomes a space (CR and LF among them)."""
    shown = "".join(" " if unicodedata.category(c) in _INVISIBLE else c for c in text)
    shown = " ".join(shown.split())
    if len(shown) > MAX_VALUE_CHARS:
        shown = shown[: MAX_VALUE_CHARS - 1] + "\u2026"
    return shown


def _plain(line: Line) -> str:
    return "".join(one_line(s.text) if isinstance(s, Untrusted) else s for s in line)


def mail_subject(message: Message) -> str:
    """The Subject: one line whatever the title holds (no header can be added through it)."""
    subject = one_line(SUBJECT_PREFIX + _plain(message.title))
    return subject[:MAX_SUBJECT_CHARS]


def mail_body(message: Message) -> str:
    """Plain text, one line per line of the message."""
    return "\n".join(_plain(line) for line in message.lines) + "\n"


def webhook_value(text: str) -> str:
    """Someone else's text for chat markdown: a code span (no formatting, no links, no
    mentions in Mattermost) with `<`, `>`, `&` (Slack's control sequences), the backquote (the
    span's end) replaced by look-alikes, and a zero-width space after `@` (no `@channel`)."""
    shown = one_line(text).translate(_WEBHOOK_LOOKALIKES).replace("@", "@" + _ZERO_WIDTH_SPACE)
    return f"`{shown}`" if shown else "(empty)"


def _markdown(line: Line) -> str:
    return "".join(webhook_value(s.text) if isinstance(s, Untrusted) else s for s in line)


def webhook_text(message: Message) -> str:
    """The `text` of a Slack/Mattermost-compatible webhook message."""
    title = f"*slurm-medic: {_markdown(message.title)}*"
    return "\n".join([title, *(_markdown(line) for line in message.lines)])
