"""The JSON codec: every stored record comes back equal, and bad JSON is refused clearly."""

from __future__ import annotations

import dataclasses
import types
import typing
from datetime import UTC, datetime, timedelta, timezone
from enum import Enum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence, OomFamily, OomReport
from daemon.slurm.records import JobState, SlurmJob
from daemon.store.codec import CodecError, from_json, to_json

AWARE_DATETIMES = st.datetimes(
    min_value=datetime(1970, 1, 2),
    max_value=datetime(2200, 1, 1),
    timezones=st.sampled_from(
        [UTC, timezone(timedelta(hours=-7)), timezone(timedelta(hours=5, minutes=30))]
    ),
)


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    """A strategy for any field type the records use; written here so datetimes are aware."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(option) for option in typing.get_args(hint)))
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return st.lists(strategy_for(item), max_size=3).map(tuple)
    if origin is frozenset:
        return st.frozensets(strategy_for(typing.get_args(hint)[0]), max_size=3)
    if hint is type(None):
        return st.none()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(hint)}
        return st.builds(hint, **fields)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return st.sampled_from(list(hint))
    simple: dict[Any, st.SearchStrategy[Any]] = {
        datetime: AWARE_DATETIMES,
        str: st.text(max_size=20),
        int: st.integers(min_value=-(2**63), max_value=2**63),
        bool: st.booleans(),
        float: st.floats(allow_nan=False),
    }
    return simple[hint]


@settings(max_examples=60, deadline=None)
@given(strategy_for(Evidence))
def test_evidence_round_trips(evidence: Evidence) -> None:
    assert from_json(Evidence, to_json(evidence)) == evidence


@settings(max_examples=60, deadline=None)
@given(strategy_for(Diagnosis))
def test_diagnosis_round_trips(diagnosis: Diagnosis) -> None:
    assert from_json(Diagnosis, to_json(diagnosis)) == diagnosis


@settings(max_examples=60, deadline=None)
@given(strategy_for(SlurmJob))
def test_slurm_job_round_trips(job: SlurmJob) -> None:
    assert from_json(SlurmJob, to_json(job)) == job


def test_encoding_is_plain_json_values() -> None:
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR, message="CUDA out of memory", requested_bytes=2
    )
    diagnosis = Diagnosis(
        kind=FailureKind.TRUE_OOM, confidence=Confidence.HIGH, reasons=("a", "b"), oom=oom
    )
    encoded = to_json(diagnosis)
    assert isinstance(encoded, dict)
    assert encoded["kind"] == "true_oom"
    assert encoded["reasons"] == ["a", "b"]
    assert isinstance(encoded["oom"], dict)
    assert encoded["oom"]["family"] == "torch_allocator"


def test_datetimes_are_written_in_utc() -> None:
    local = datetime(2026, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    assert to_json(local) == "2026-01-01T10:00:00+00:00"


def test_naive_datetime_is_refused() -> None:
    with pytest.raises(CodecError, match="naive datetime"):
        to_json(datetime(2026, 1, 1))


def test_unknown_field_is_refused_by_name() -> None:
    data = to_json(Diagnosis(kind=FailureKind.UNKNOWN, confidence=Confidence.LOW, reasons=()))
    assert isinstance(data, dict)
    data["surprise"] = 1
    with pytest.raises(CodecError, match="unknown fields surprise"):
        from_json(Diagnosis, data)


def test_missing_field_with_default_takes_the_default() -> None:
    data = {"kind": "not_oom", "confidence": "low", "reasons": ["x"]}
    assert from_json(Diagnosis, data) == Diagnosis(
        kind=FailureKind.NOT_OOM, confidence=Confidence.LOW, reasons=("x",)
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "boom", "confidence": "low", "reasons": []}, "Diagnosis.kind"),
        ({"kind": "not_oom", "confidence": "low"}, "missing field reasons"),
        ({"kind": "not_oom", "confidence": "low", "reasons": "x"}, "expected a list"),
        ({"kind": "not_oom", "confidence": "low", "reasons": [], "step": "7"}, "Diagnosis.step"),
        ({"kind": "not_oom", "confidence": "low", "reasons": [], "step": True}, "Diagnosis.step"),
        ([], "expected an object"),
    ],
)
def test_malformed_json_gets_a_clear_error(data: object, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        from_json(Diagnosis, data)


def test_naive_datetime_in_json_is_refused() -> None:
    encoded = to_json(_job())
    assert isinstance(encoded, dict)
    encoded["end_time"] = "2026-01-01T00:00:00"
    with pytest.raises(CodecError, match=r"SlurmJob\.end_time"):
        from_json(SlurmJob, encoded)


def _job() -> SlurmJob:
    return SlurmJob(
        job_id=1,
        name="n",
        user="u",
        uid=None,
        group=None,
        account=None,
        partition=None,
        state=JobState.FAILED,
        state_raw="FAILED",
        exit_code=1,
        exit_signal=None,
        derived_exit_code=None,
        derived_exit_signal=None,
        nodes=(),
        batch_host=None,
        submit_time=None,
        start_time=None,
        end_time=datetime(2026, 1, 1, tzinfo=UTC),
        stdout_path=None,
        stderr_path=None,
        work_dir=None,
        comment=None,
    )
