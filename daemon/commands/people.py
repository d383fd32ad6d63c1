"""The commands for people that act: approve, reject, pause, resume (and `nodes`' admin
helpers: who is asking and on what authority).

Each writes the record through the repository functions and says what it did, for a person
or, with `--json`, for a script; the commands that only read (status, history, show) are
`record_views`. Who is acting is taken from the operating system, never from a flag: the real
uid, or under `sudo` the uid that ran sudo (`SUDO_UID` is believed only when we are root, since
only sudo can have set it then). A decision is allowed to the job's owner, a member of
`policy.admin_groups`, or root itself; under sudo the groups come from the system config alone
(`config.load_settings` refuses any other). Each decision and each refused attempt is an audit
event naming the person.

Exit codes: 0 done; 1 not in the record, or a config that cannot be read; 2 usage, or an
option or variable refused under sudo; 3 not allowed; 4 the record cannot be used
(missing, unreachable, locked, corrupt, or at another schema).
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click
from sqlalchemy.orm import Session

from daemon.commands.context import CommandContext, record_options, say
from daemon.config import Settings
from daemon.privilege import sudo_caller
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.models import Incident, Proposal
from daemon.store.states import IllegalTransition, ProposalState


class NotAllowed(click.ClickException):
    """The person may not do this (exit 3, distinct from a usage error or a missing row)."""

    exit_code = 3


@dataclass(frozen=True)
class Person:
    """Who runs the command, as the OS says; `is_root` only for root without sudo."""

    name: str
    uid: int
    groups: frozenset[str]
    is_root: bool

    @property
    def actor(self) -> repo.Actor:
        return repo.Actor.user(self.name, self.uid)


def invoking_person(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Person:
    """The person behind this process: sudo's caller when root ran through sudo."""
    environ = os.environ if environ is None else environ
    real = os.getuid() if uid is None else uid
    is_root = real == 0
    caller = sudo_caller(environ, real)
    if caller is not None:
        real, is_root = caller, False
    try:
        entry = pwd.getpwuid(real)
    except KeyError as error:
        raise NotAllowed(f"uid {real} has no passwd entry; who is asking?") from error
    return Person(name=entry.pw_name, uid=real, groups=groups_of(entry), is_root=is_root)


def groups_of(entry: pwd.struct_passwd) -> frozenset[str]:
    """The names of the user's groups in the OS group database (a gid with no name left out)."""
    names = set()
    for gid in os.getgrouplist(entry.pw_name, entry.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return frozenset(names)


def authority(person: Person, *, owner: str | None, settings: Settings) -> str | None:
    """On what grounds the person may decide (None: they may not)."""
    if person.is_root:
        return "root"
    admin = sorted(person.groups & set(settings.policy.admin_groups))
    if admin:
        return f"admin group {admin[0]}"
    if owner is not None and person.name == owner:
        return "job owner"
    return None


def may_see(person: Person, *, owner: str | None, settings: Settings) -> bool:
    """Whether the person may see a run of `owner` (None: of no one, or every run): the one
    rule of the web and of the CLI under sudo. Who may decide on a run may see it (`authority`:
    its owner, an admin, root), unless the site lets everyone see everything
    (`web.everyone_sees_all`, from the system config alone under sudo)."""
    if settings.web.everyone_sees_all:
        return True
    return authority(person, owner=owner, settings=settings) is not None


# ---------------------------------------------------------------- decisions


class ProposalMissing(click.ClickException):
    """No such proposal in the record (exit 1, click's)."""


class NotWaiting(NotAllowed):
    """The proposal is no longer waiting for a decision (decided, acted on, or withdrawn)."""


def decide(
    session: Session,
    settings: Settings,
    person: Person,
    *,
    proposal_id: int,
    to: ProposalState,
    reason: str,
    via: str | None = None,
) -> dict[str, Any]:
    """Approve or reject on the person's authority, and say what was done; the caller commits
    (the web stores its idempotency key in the same transaction).

    The one path of the CLI and the web (`via="web"`, noted in the audit details): a person
    without authority is refused with an audit event naming them (`NotAllowed`, committed
    first); a proposal no longer waiting raises `NotWaiting`, a missing one `ProposalMissing`.
    """
    proposal = session.get(Proposal, proposal_id)
    if proposal is None:
        raise ProposalMissing(f"no proposal {proposal_id} in the record")
    incident = session.get(Incident, proposal.incident_id)
    owner = incident.user_name if incident is not None else None
    verb = "approve" if to is ProposalState.APPROVED else "reject"
    channel = {} if via is None else {"via": via}
    grounds = authority(person, owner=owner, settings=settings)
    if grounds is None:
        repo.append_audit(
            session,
            actor=person.actor,
            verb=f"{verb}_refused",
            subject_type="proposal",
            subject_id=proposal_id,
            details={"owner": owner, "reason": "neither the job owner nor an admin", **channel},
        )
        session.commit()
        raise NotAllowed(
            f"{person.name} may not {verb} proposal {proposal_id}: only its job's owner"
            f" ({owner}) or a member of policy.admin_groups may"
        )
    try:
        repo.transition_proposal(
            session, proposal_id=proposal_id, to=to, actor=person.actor, reason=reason
        )
    except IllegalTransition as error:
        session.rollback()
        raise NotWaiting(f"proposal {proposal_id} is {error.current}: {error}") from error
    repo.append_audit(
        session,
        actor=person.actor,
        verb="decision_authority",
        subject_type="proposal",
        subject_id=proposal_id,
        details={"decision": to.value, "grounds": grounds, **channel},
    )
    return {
        "proposal": proposal_id,
        "state": to.value,
        "by": person.name,
        "uid": person.uid,
        "grounds": grounds,
        "reason": reason,
    }


def _decide(
    proposal_id: int,
    *,
    to: ProposalState,
    reason: str,
    config_path: str | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    person = invoking_person()
    with context.session() as session:
        document = decide(
            session, context.settings, person, proposal_id=proposal_id, to=to, reason=reason
        )
        session.commit()
    context.emit(
        document,
        say(
            lambda shown: f"proposal {proposal_id} {to.value} by {shown['by']} ({shown['grounds']})"
        ),
    )


@click.command("approve")
@click.argument("proposal_id", metavar="PROPOSAL", type=click.IntRange(min=1))
@click.option("--comment", default="", help="Why, for the record.")
@record_options
def approve_command(
    proposal_id: int,
    comment: str,
    config_path: str | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Approve a waiting proposal (the job's owner, an admin group member, or root)."""
    _decide(
        proposal_id,
        to=ProposalState.APPROVED,
        reason=comment,
        config_path=config_path,
        database_url=database_url,
        as_json=as_json,
    )


@click.command("reject")
@click.argument("proposal_id", metavar="PROPOSAL", type=click.IntRange(min=1))
@click.option("--why", required=True, help="The reason, for the record (required).")
@record_options
def reject_command(
    proposal_id: int, why: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """Reject a waiting proposal; the reason goes on the record."""
    if not why.strip():
        raise click.BadParameter("say why", param_hint="--why")
    _decide(
        proposal_id,
        to=ProposalState.REJECTED,
        reason=why,
        config_path=config_path,
        database_url=database_url,
        as_json=as_json,
    )


# ---------------------------------------------------------------- admins and the pause


def require_admin(person: Person, settings: Settings, what: str) -> str:
    """The grounds of an admin (root or policy.admin_groups), else NotAllowed."""
    grounds = authority(person, owner=None, settings=settings)
    if grounds is None:
        raise NotAllowed(f"{person.name} may not {what}: root or policy.admin_groups only")
    return grounds


def require_admin_on_record(
    session: Session,
    person: Person,
    settings: Settings,
    *,
    what: str,
    verb: str,
    subject: str,
    details: Mapping[str, object] | None = None,
) -> str:
    """As `require_admin` for what touches nodes: a refusal is an audit event naming the person,
    committed before the command ends, so an admin can see who tried."""
    try:
        return require_admin(person, settings, what)
    except NotAllowed:
        repo.append_audit(
            session,
            actor=person.actor,
            verb=verb,
            subject_type="node",
            subject_id=subject,
            details={**(details or {}), "reason": "neither root nor in policy.admin_groups"},
        )
        session.commit()
        raise


def _set_pause(
    paused: bool, why: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    context = CommandContext.load(config_path, database_url, as_json=as_json)
    person = invoking_person()
    require_admin(person, context.settings, "pause or resume slurm-medic")
    with context.session() as session:
        control.set_paused(session, paused=paused, actor=person.actor, reason=why)
        session.commit()
    document = {"paused": paused, "by": person.name, "reason": why}
    word = "paused: proposals are recorded, nothing is acted on" if paused else "resumed"
    context.emit(document, say(lambda _: f"slurm-medic {word}"))


@click.command("pause")
@click.option("--why", default="", help="The reason, for the record.")
@record_options
def pause_command(
    why: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """Stop acting (every daemon on this record): proposals are still made and recorded."""
    _set_pause(True, why, config_path, database_url, as_json)


@click.command("resume")
@click.option("--why", default="", help="The reason, for the record.")
@record_options
def resume_command(
    why: str, config_path: str | None, database_url: str | None, as_json: bool
) -> None:
    """Lift the pause."""
    _set_pause(False, why, config_path, database_url, as_json)
