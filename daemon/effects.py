"""One way to perform a side effect on the cluster (scancel, drain, resume) with its action row.

The row is written and committed before the command runs, so a crash in between leaves a
pending action on the record rather than an effect nobody wrote down; the outcome (success, or
Slurm's refusal in its own words) closes the row. Relaunches have their own exactly-once
protocol (`action_rows.record_submit_intent`): a lost sbatch answer must be found again by token,
where a repeated scancel, drain or resume does no harm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from daemon.slurm.errors import SlurmError
from daemon.store import action_rows
from daemon.store.models import Action, ActionKind
from daemon.store.repository import Actor


@dataclass(frozen=True)
class Performed:
    """The recorded action, and Slurm's refusal when the command failed (None: it ran)."""

    action: Action
    error: SlurmError | None = None

    @property
    def succeeded(self) -> bool:
        return self.error is None


def perform(
    session: Session,
    *,
    kind: ActionKind,
    argv: list[str],
    actor: Actor,
    run: Callable[[], object],
    node: str | None = None,
    proposal_id: int | None = None,
) -> Performed:
    """Record the action, commit, run it, record how it went, commit."""
    action = action_rows.record_action(
        session, kind=kind, argv=argv, actor=actor, node=node, proposal_id=proposal_id
    )
    session.commit()
    try:
        run()
    except SlurmError as error:
        action_rows.finish_action(
            session,
            action_id=action.id,
            exit_code=None,
            stdout="",
            stderr=str(error),
            succeeded=False,
        )
        session.commit()
        return Performed(action, error)
    action_rows.finish_action(
        session, action_id=action.id, exit_code=0, stdout="", stderr="", succeeded=True
    )
    session.commit()
    return Performed(action)
