"""The planner's memory of a proposal on a real record (SQLite and PostgreSQL): written in one
place, read back typed in one place, its queried fields real columns, and a renamed or missing
key an error rather than a default."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from daemon.commands.story import lineage_document
from daemon.dialects import get_dialect
from daemon.dialects.base import KnobValue
from daemon.pipeline import handle_ended_job, planner_history
from daemon.planner import AttemptRecord, Outcome, PlannedFix
from daemon.store import repository as repo
from daemon.store.codec import CodecError, from_json, to_json
from daemon.store.models import Proposal
from remediators.base import Lever
from tests.fixes import seeded_fix
from tests.test_pipeline import FRAGMENTED, deps, failed_job, pretend_relaunched, start_lineage

ENV_AFTER = (("PYTORCH_ALLOC_CONF", "expandable_segments:True"),)
WORDS = st.text(max_size=6)
# Every shape `dialects.base.KnobValue` takes: numbers, switches, text, names, env pairs.
KNOB_VALUES = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.booleans(),
    WORDS,
    st.lists(WORDS, max_size=3).map(tuple),
    st.lists(st.tuples(WORDS, WORDS), min_size=1, max_size=3).map(tuple),
)


@settings(max_examples=80, deadline=None)
@given(
    before=st.dictionaries(WORDS, KNOB_VALUES, max_size=4),
    after=st.dictionaries(WORDS, KNOB_VALUES, max_size=4),
    change=st.tuples(KNOB_VALUES, KNOB_VALUES),
)
def test_knob_values_of_every_shape_come_back_as_they_were(
    before: dict[str, KnobValue], after: dict[str, KnobValue], change: tuple[KnobValue, KnobValue]
) -> None:
    fix = dataclasses.replace(
        seeded_fix(changes=(("knob", *change),)),
        knobs_before=before,
        knobs_after=after,
    )
    assert from_json(PlannedFix, to_json(fix)) == fix


def _proposed(session: Session, job_id: int) -> tuple[int, Proposal]:
    lineage_id = start_lineage(session, job_id)
    result = handle_ended_job(session, failed_job(job_id), deps({job_id: FRAGMENTED}))
    assert result.proposal_id is not None
    row = session.get(Proposal, result.proposal_id)
    assert row is not None
    return lineage_id, row


def test_a_planned_fix_comes_back_equal_with_its_queried_fields_as_columns(
    db_session: Session,
) -> None:
    _lineage_id, row = _proposed(db_session, 7001)
    record = repo.attempt_record(row)
    fix = record.fix
    assert (fix.remediator, fix.lever, fix.rung, fix.failing_step) == (
        "allocator_expandable_segments",
        Lever.ALLOCATOR,
        0,
        4,
    )
    assert dict(fix.knobs_after)["env"] == ENV_AFTER
    assert [change.knob for change in fix.patch.changes] == ["env"]
    assert (row.remediator, row.lever, row.rung, row.failing_step) == (
        "allocator_expandable_segments",
        "allocator",
        0,
        4,
    )
    assert not {"remediator", "lever", "rung", "failing_step"} & set(row.plan)
    assert record == AttemptRecord(fix, None, None, Outcome.PENDING, None)
    assert from_json(PlannedFix, to_json(fix)) == fix
    db_session.expire_all()
    assert db_session.scalars(select(Proposal.id).where(Proposal.lever == "allocator")).all() == [
        row.id
    ]


def test_the_relaunch_and_its_judgement_land_in_columns_and_in_the_record(
    db_session: Session,
) -> None:
    lineage_id, row = _proposed(db_session, 7101)
    pretend_relaunched(db_session, row.id, 7102, lineage_id)
    repo.record_outcome(db_session, proposal=row, outcome=Outcome.SAME_FAILURE, step_reached=3)
    db_session.expire_all()
    stored = db_session.get(Proposal, row.id)
    assert stored is not None
    assert (stored.outcome, stored.step_reached) == ("same_failure", 3)
    record = repo.attempt_record(stored)
    assert record.revision_id == stored.revision_id is not None
    assert (record.outcome, record.step_reached) == (Outcome.SAME_FAILURE, 3)
    (attempt,) = planner_history(
        db_session, lineage_id=lineage_id, dialect=get_dialect("torchrun")
    ).attempts
    assert (attempt.outcome, attempt.failing_step, attempt.step_reached) == (
        Outcome.SAME_FAILURE,
        4,
        3,
    )
    assert not attempt.made_progress


@pytest.mark.parametrize(
    ("rename", "error"),
    [
        ({"expected_effect": "expected"}, "unknown fields expected"),
        ({"knobs_before": None}, "missing field knobs_before"),
    ],
)
def test_a_renamed_or_missing_key_is_an_error_never_a_default(
    db_session: Session, rename: dict[str, str | None], error: str
) -> None:
    lineage_id, row = _proposed(db_session, 7201)
    pretend_relaunched(db_session, row.id, 7202, lineage_id)
    plan = dict(row.plan)
    for old, new in rename.items():
        value = plan.pop(old)
        if new is not None:
            plan[new] = value
    row.plan = plan
    db_session.flush()
    with pytest.raises(CodecError, match=error):
        repo.attempt_record(row)
    with pytest.raises(CodecError, match=error):
        planner_history(db_session, lineage_id=lineage_id, dialect=get_dialect("torchrun"))


def test_a_plan_that_repeats_a_column_is_refused(db_session: Session) -> None:
    """Two copies of the rung could disagree; the record keeps one."""
    _lineage_id, row = _proposed(db_session, 7301)
    row.plan = {**row.plan, "rung": 3}
    with pytest.raises(CodecError, match="plan repeats its columns rung"):
        repo.attempt_record(row)


@pytest.mark.parametrize(("column", "value"), [("outcome", "half_verified"), ("lever", "magic")])
def test_the_database_refuses_a_value_outside_its_enum(
    db_session: Session, column: str, value: str
) -> None:
    _lineage_id, row = _proposed(db_session, 7401)
    setattr(row, column, value)
    with pytest.raises(IntegrityError):
        db_session.flush()


def test_people_see_an_unreadable_record_said_so_and_the_rest_of_the_story(
    db_session: Session,
) -> None:
    lineage_id, row = _proposed(db_session, 7501)
    readable = repo.propose(
        db_session,
        incident_id=row.incident_id,
        fix=seeded_fix(expected_effect="activations halve", failing_step=2),
        rationale="halve the micro-batch",
        cost=1.0,
        changes_science=False,
        actor=repo.Actor.daemon(),
    )
    row.plan = {key: value for key, value in row.plan.items() if key != "skipped"}
    db_session.flush()
    (attempt,) = lineage_document(db_session, lineage_id=lineage_id)["attempts"]
    broken, good = attempt["proposals"]
    assert "missing field skipped" in broken["unreadable"]
    assert (broken["lever"], broken["changes"], broken["outcome"]) == ("allocator", [], None)
    assert good["id"] == readable.id
    assert "unreadable" not in good
    assert good["changes"] == [{"knob": "micro_batch", "before": 8, "after": 4}]
    assert (good["expected_effect"], good["failing_step"], good["outcome"]) == (
        "activations halve",
        2,
        "pending",
    )
