"""The policy: what goes ahead without a person, and when acting must wait."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from daemon.config import PolicySettings
from daemon.policy import Decision, Hold, ProposalFacts, RecentActivity, decide, gate

QUIET = RecentActivity(relaunches_by_user=0, relaunches=0, drains=0)


def test_an_allocator_fix_is_approved_with_its_reason() -> None:
    verdict = decide(ProposalFacts("allocator_expandable_segments", False), PolicySettings())
    assert verdict.decision is Decision.AUTO_APPROVE
    assert "policy.auto_approve" in verdict.reasons[0]


def test_a_batch_cut_waits_because_it_is_not_listed() -> None:
    verdict = decide(ProposalFacts("micro_batch_down", False), PolicySettings())
    assert verdict.decision is Decision.WAIT_FOR_PERSON
    assert verdict.reasons == ("micro_batch_down is not in policy.auto_approve",)


@given(remediator=st.sampled_from(PolicySettings().auto_approve), listed=st.booleans())
def test_anything_that_changes_the_science_always_waits(remediator: str, listed: bool) -> None:
    settings = PolicySettings(auto_approve=(remediator,) if listed else ())
    verdict = decide(ProposalFacts(remediator, changes_science=True), settings)
    assert not verdict.approved
    assert any("changes the science" in reason for reason in verdict.reasons)


def test_an_unmanaged_job_is_never_approved() -> None:
    verdict = decide(ProposalFacts("exclude_node", False, managed=False), PolicySettings())
    assert not verdict.approved


def test_pause_and_dry_run_hold_everything() -> None:
    facts = ProposalFacts("exclude_node", False)
    assert gate(facts, QUIET, PolicySettings(), paused=True).holds == (Hold.PAUSED,)
    held = gate(facts, QUIET, PolicySettings(dry_run=True, paused=True), paused=False)
    assert held.holds == (Hold.PAUSED, Hold.DRY_RUN)
    assert gate(facts, QUIET, PolicySettings(), paused=False).may_act


def test_rate_limits_hold_at_the_limit_not_before() -> None:
    settings = PolicySettings(max_relaunches_per_user_per_hour=2, max_relaunches_per_hour=5)
    facts = ProposalFacts("exclude_node", False)
    under = RecentActivity(relaunches_by_user=1, relaunches=4, drains=0)
    assert gate(facts, under, settings, paused=False).may_act
    at_user = RecentActivity(relaunches_by_user=2, relaunches=2, drains=0)
    assert gate(facts, at_user, settings, paused=False).holds == (Hold.USER_RATE,)
    at_cluster = RecentActivity(relaunches_by_user=0, relaunches=5, drains=0)
    assert gate(facts, at_cluster, settings, paused=False).holds == (Hold.CLUSTER_RATE,)


@given(
    limit=st.integers(min_value=0, max_value=5),
    done=st.integers(min_value=0, max_value=8),
    wanted=st.lists(st.sampled_from(["gpu-01", "gpu-02", "gpu-03"]), unique=True),
)
def test_the_breaker_never_lets_drains_exceed_the_hourly_limit(
    limit: int, done: int, wanted: list[str]
) -> None:
    facts = ProposalFacts("drain_and_exclude", False, drains=tuple(wanted))
    verdict = gate(
        facts,
        RecentActivity(relaunches_by_user=0, relaunches=0, drains=done),
        PolicySettings(max_drains_per_hour=limit),
        paused=False,
    )
    allowed = [node for node in wanted if node not in verdict.drop_drains]
    assert done + len(allowed) <= max(limit, done)
    assert len(allowed) == min(len(wanted), max(0, limit - done))
    assert verdict.may_act  # the relaunch itself still goes ahead, excluding the nodes
