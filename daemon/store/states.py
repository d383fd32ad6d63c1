"""The proposal's life as one explicit transition table; every other module asks it."""

from __future__ import annotations

from enum import StrEnum


class ProposalState(StrEnum):
    PROPOSED = "proposed"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    SUBMITTING = "submitting"
    SUBMITTED = "submitted"
    VERIFYING = "verifying"
    VERIFIED = "verified"
    FAILED = "failed"
    SUPERSEDED = "superseded"

    def is_terminal(self) -> bool:
        return not TRANSITIONS[self]


# Why each move exists: a proposal waits for a decision, then is submitted exactly once
# (intent first), then followed until verified. `submitting -> approved` is the start-up
# reconciliation finding no job with the intent's token: the relaunch never happened and
# may be tried again under a new token. A newer proposal for the same lineage supersedes
# one that has not reached a final state.
TRANSITIONS: dict[ProposalState, frozenset[ProposalState]] = {
    ProposalState.PROPOSED: frozenset(
        {
            ProposalState.APPROVED,
            ProposalState.REJECTED,
            ProposalState.EXPIRED,
            ProposalState.SUPERSEDED,
        }
    ),
    ProposalState.APPROVED: frozenset({ProposalState.SUBMITTING, ProposalState.SUPERSEDED}),
    ProposalState.SUBMITTING: frozenset(
        {ProposalState.SUBMITTED, ProposalState.FAILED, ProposalState.APPROVED}
    ),
    ProposalState.SUBMITTED: frozenset({ProposalState.VERIFYING, ProposalState.FAILED}),
    ProposalState.VERIFYING: frozenset(
        {ProposalState.VERIFIED, ProposalState.FAILED, ProposalState.SUPERSEDED}
    ),
    ProposalState.REJECTED: frozenset(),
    ProposalState.EXPIRED: frozenset(),
    ProposalState.VERIFIED: frozenset(),
    ProposalState.FAILED: frozenset(),
    ProposalState.SUPERSEDED: frozenset(),
}


class IllegalTransition(Exception):
    """A proposal asked to move where the table does not allow."""

    def __init__(self, current: ProposalState, wanted: ProposalState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "nothing (final)"
        super().__init__(f"proposal cannot go from {current} to {wanted}; allowed: {allowed}")
        self.current = current
        self.wanted = wanted


def check_transition(current: ProposalState, wanted: ProposalState) -> None:
    """Raise `IllegalTransition` unless the table allows `current -> wanted`."""
    if wanted not in TRANSITIONS[current]:
        raise IllegalTransition(current, wanted)
