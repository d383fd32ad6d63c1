"""The daemon's share of the sweep each cycle: which nodes are due by the schedule, which by a
job's end, and that a node is never probed twice in one cycle or the whole fleet at once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from daemon.config import Settings, SweepSettings
from daemon.evidence.prober import NodeProber, ProbeSettings, RawProbe
from daemon.evidence.records import ProbeVerdict
from daemon.fleet.findings import NodeJudgement
from daemon.fleet.scheduled import AFTER_JOB_CURSOR, ENDED_STATES, scheduled_targets
from daemon.fleet.sweep import SweepDeps
from daemon.slurm.records import JobState, JobWindow, NodeBaseState, SlurmNode
from daemon.store import control, node_records
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import CheckTrigger
from daemon.store.repository import Actor
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.factories import ended_job

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
INTERVAL_S = 600.0
FLEET = tuple(f"gpu-{index:03d}" for index in range(1, 41))


@dataclass
class FakeSlurm:
    """Only what the schedule reads: the nodes and the jobs that ended in a window."""

    ended: list[object] = field(default_factory=list)
    windows: list[tuple[datetime, datetime, frozenset[JobState]]] = field(default_factory=list)

    def nodes(self) -> tuple[SlurmNode, ...]:
        gpu = tuple(
            SlurmNode(name, None, NodeBaseState.IDLE, frozenset(), None, None, None, "gpu:8")
            for name in FLEET
        )
        login = SlurmNode("login-1", None, NodeBaseState.IDLE, frozenset(), None, None, None)
        return (*gpu, login)

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> JobWindow:
        self.windows.append((since, until, frozenset(states)))
        return JobWindow(tuple(self.ended))  # type: ignore[arg-type]


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    upgrade(engine)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


def _deps(tmp_path: Path, slurm: FakeSlurm, **sweep: object) -> SweepDeps:
    for name in ("key", "known_hosts"):
        (tmp_path / name).write_text("x")
    probe = ProbeSettings(key_path=tmp_path / "key", known_hosts_path=tmp_path / "known_hosts")
    sweeping = SweepSettings.model_validate({"enabled": True, "interval_s": INTERVAL_S, **sweep})
    settings = Settings(probe=probe, sweep=sweeping)
    prober = NodeProber(probe, fetch=lambda node: RawProbe(node, NOW, None, "not used"))
    return SweepDeps(settings, slurm, prober, lambda: NOW, Actor.daemon())  # type: ignore[arg-type]


def _check(session: Session, node: str, at: datetime) -> None:
    judgement = NodeJudgement(node, at, ProbeVerdict.HEALTHY, (), "8 GPUs of 8", 8, 8, ())
    node_records.record_check(
        session,
        judgement,
        trigger=CheckTrigger.SCHEDULE,
        decision="record",
        decision_reason="healthy",
        actor_name="slurm-medic",
    )


def test_a_first_start_probes_no_node_at_once_then_each_at_its_moment(
    session: Session, tmp_path: Path
) -> None:
    deps = _deps(tmp_path, FakeSlurm(), after_job=False)
    assert (
        scheduled_targets(session, deps, deps.backend.nodes(), now=NOW) == []
    )  # the sweep starts here
    seen: list[str] = []
    step = timedelta(seconds=INTERVAL_S / 20)
    for tick in range(1, 21):
        now = NOW + tick * step
        due = scheduled_targets(session, deps, deps.backend.nodes(), now=now)
        for target in due:
            assert target.trigger is CheckTrigger.SCHEDULE
            assert target.window_start == now - timedelta(seconds=INTERVAL_S)
            _check(session, target.node, now)
        seen += [target.node for target in due]
        # Spread: no twentieth of the interval takes more than a quarter of the fleet.
        assert len(due) <= len(FLEET) // 4
    assert sorted(seen) == sorted(FLEET)  # every GPU node once per interval, never login-1


def test_a_node_is_due_again_one_interval_after_its_check_reading_from_it(
    session: Session, tmp_path: Path
) -> None:
    deps = _deps(tmp_path, FakeSlurm(), after_job=False, nodes="gpu-[001-002]")
    control.set_cursor(session, name="fleet_sweep_started", polled_until=NOW - timedelta(days=1))
    first = {
        target.node for target in scheduled_targets(session, deps, deps.backend.nodes(), now=NOW)
    }
    assert first == {"gpu-001", "gpu-002"}
    checked = NOW - timedelta(seconds=1)
    _check(session, "gpu-001", checked)
    _check(session, "gpu-002", checked)
    assert scheduled_targets(session, deps, deps.backend.nodes(), now=NOW) == []
    later = NOW + timedelta(seconds=INTERVAL_S)
    again = scheduled_targets(session, deps, deps.backend.nodes(), now=later)
    assert {target.node for target in again} == {"gpu-001", "gpu-002"}
    assert {target.window_start for target in again} == {checked}


def test_a_jobs_end_brings_a_check_of_its_nodes_once(session: Session, tmp_path: Path) -> None:
    ended = NOW - timedelta(seconds=30)
    slurm = FakeSlurm(
        ended=[
            ended_job(41, end=ended, nodes=("gpu-003", "gpu-004"), state=JobState.COMPLETED),
            ended_job(42, end=ended, nodes=("gpu-004", "login-1")),
            ended_job(43, end=ended, nodes=("gpu-005",)),
        ]
    )
    deps = _deps(tmp_path, slurm)
    control.set_cursor(session, name="fleet_sweep_started", polled_until=NOW)
    control.set_cursor(session, name=AFTER_JOB_CURSOR, polled_until=NOW - timedelta(minutes=5))
    _check(session, "gpu-005", NOW - timedelta(seconds=5))  # checked after job 43 ended

    targets = scheduled_targets(session, deps, deps.backend.nodes(), now=NOW)

    assert [(t.node, t.trigger, t.after_job_id) for t in targets] == [
        ("gpu-003", CheckTrigger.AFTER_JOB, 41),
        ("gpu-004", CheckTrigger.AFTER_JOB, 41),
    ]
    assert targets[0].window_start == ended - timedelta(hours=1)  # the job's start
    ((since, until, states),) = slurm.windows
    assert (since, until) == (NOW - timedelta(minutes=7), NOW)  # from the cursor, overlapping
    assert states == frozenset(ENDED_STATES)
    assert JobState.COMPLETED in states  # a clean end is checked too, as an epilog would
    assert control.get_cursor(session, name=AFTER_JOB_CURSOR) == NOW
