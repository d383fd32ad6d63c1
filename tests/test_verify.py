"""Verification: the step margin AND a newer checkpoint; the same failure climbs, others stop."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.planner import Outcome
from daemon.verify import Progress, judge_progress, relaunch_outcome


def test_verified_only_with_both_the_margin_and_a_new_checkpoint() -> None:
    def judge(seen: int | None, newest: int | None) -> bool:
        return judge_progress(
            failing_step=4,
            resumed_step=2,
            margin_steps=2,
            progress=Progress(max_step_seen=seen, newest_checkpoint_step=newest),
        ).verified

    assert judge(6, 6)
    assert not judge(5, 6)  # short of the margin
    assert not judge(6, 2)  # only the checkpoint it resumed from
    assert not judge(6, None)
    assert not judge(None, 8)


def test_the_reasons_say_what_is_missing() -> None:
    verdict = judge_progress(
        failing_step=4,
        resumed_step=2,
        margin_steps=2,
        progress=Progress(max_step_seen=5, newest_checkpoint_step=2),
    )
    assert verdict.reasons == (
        "has not logged step 6 yet (seen 5)",
        "no checkpoint newer than step 2 yet (newest 2)",
    )


def test_a_run_that_had_no_checkpoint_is_verified_by_its_first_one() -> None:
    verdict = judge_progress(
        failing_step=0,
        resumed_step=None,
        margin_steps=1,
        progress=Progress(max_step_seen=3, newest_checkpoint_step=2),
    )
    assert verdict.verified


@given(
    failing=st.integers(0, 1000),
    margin=st.integers(0, 50),
    seen=st.integers(0, 2000),
    resumed=st.none() | st.integers(0, 1000),
    newest=st.none() | st.integers(0, 2000),
)
def test_never_verified_short_of_the_margin(
    failing: int, margin: int, seen: int, resumed: int | None, newest: int | None
) -> None:
    verdict = judge_progress(
        failing_step=failing,
        resumed_step=resumed,
        margin_steps=margin,
        progress=Progress(max_step_seen=seen, newest_checkpoint_step=newest),
    )
    if verdict.verified:
        assert seen >= failing + margin
        assert newest is not None
        assert resumed is None or newest > resumed


def test_same_kind_climbs_the_ladder_another_kind_asks_a_person() -> None:
    again = Diagnosis(FailureKind.FRAGMENTATION, Confidence.HIGH, ("again",))
    assert relaunch_outcome(FailureKind.FRAGMENTATION, again) is Outcome.SAME_FAILURE
    other = Diagnosis(FailureKind.HOST_RAM, Confidence.HIGH, ("host",))
    assert relaunch_outcome(FailureKind.FRAGMENTATION, other) is Outcome.DIFFERENT_FAILURE
