"""A sweep end to end below Slurm: the real probe program's documents for each node state, a
real record (both databases), and Slurm faked at its seam. A faulty node is drained on the
record (action, node event, check), a pending remap waits for its job, the breaker counts the
incidents' drains with the sweep's, and only the daemon's pending-remap drain returns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.config import PolicySettings, Settings, SweepSettings
from daemon.evidence.prober import NodeProber, ProbeSettings, RawProbe
from daemon.evidence.records import FindingKind, ProbeVerdict
from daemon.fleet.findings import CORDON_FINDING
from daemon.fleet.node_policy import NodeDecisionKind
from daemon.fleet.sweep import (
    SweepDeps,
    SweepTarget,
    SweptNode,
    running_by_node,
    sweep,
    sweep_nodes,
)
from daemon.slurm.errors import NodeNotFound, OperationRefused
from daemon.slurm.records import JobState, NodeBaseState, SlurmJob, SlurmNode
from daemon.store import control
from daemon.store.models import (
    Action,
    ActionKind,
    ActionResult,
    CheckTrigger,
    NodeCheck,
    NodeEvent,
    NodeEventKind,
)
from daemon.store.repository import Actor
from tests.factories import ended_job
from tests.test_actions_store import FakeSlurm
from tests.test_probe import run_probe_program

DAEMON = Actor.daemon()


@cache
def probe_document(state: str) -> str:
    return run_probe_program(state)


def gpu_node(name: str) -> SlurmNode:
    return SlurmNode(name, name, NodeBaseState.IDLE, frozenset(), None, None, None, "gpu:a100:8")


@dataclass
class FleetSlurm(FakeSlurm):
    """Slurm's nodes and running jobs as a sweep reads them; drain and resume change them."""

    states: dict[str, SlurmNode] = field(default_factory=dict)
    running: list[SlurmJob] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    refuse_drain: bool = False

    def nodes(self) -> tuple[SlurmNode, ...]:
        return tuple(self.states.values())

    def node(self, name: str) -> SlurmNode:
        if name not in self.states:
            raise NodeNotFound(name)
        return self.states[name]

    def running_jobs(self, *, users: Iterable[str] = ()) -> tuple[SlurmJob, ...]:
        return tuple(self.running)

    def drain(self, node: str, reason: str) -> None:
        if self.refuse_drain:
            raise OperationRefused(f"{node} is drained by someone else")
        super().drain(node, reason)
        self.states[node] = replace(
            self.states[node], flags=frozenset({"DRAIN"}), reason=reason, reason_user="slurm"
        )

    def resume(self, node: str) -> None:
        self.resumed.append(node)
        self.states[node] = replace(
            self.states[node], flags=frozenset(), reason=None, reason_user=None
        )


class FixtureNodes:
    """Each node's fixture state, as `set-node-state` installs it; a node without one is down."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states = states

    def __call__(self, node: str) -> RawProbe:
        now = datetime.now(UTC)
        state = self.states.get(node)
        if state is None:
            return RawProbe(node, now, None, f"{node}: connection refused")
        return RawProbe(node, now, probe_document(state))


@pytest.fixture
def probe_settings(tmp_path: Path) -> ProbeSettings:
    (tmp_path / "key").write_text("k")
    (tmp_path / "known_hosts").write_text("")
    return ProbeSettings(
        key_path=tmp_path / "key", known_hosts_path=tmp_path / "known_hosts", cache_ttl_s=0
    )


@dataclass
class Cluster:
    slurm: FleetSlurm
    nodes: FixtureNodes
    deps: SweepDeps


def cluster(
    probe: ProbeSettings,
    states: dict[str, str],
    *,
    sweep_settings: SweepSettings | None = None,
    max_drains: int = 2,
) -> Cluster:
    slurm = FleetSlurm(states={name: gpu_node(name) for name in states})
    nodes = FixtureNodes(dict(states))
    settings = Settings(
        probe=probe,
        sweep=sweep_settings or SweepSettings(),
        policy=PolicySettings(max_drains_per_hour=max_drains),
    )
    deps = SweepDeps(
        settings=settings,
        backend=slurm,
        prober=NodeProber(probe, fetch=nodes),
        clock=lambda: datetime.now(UTC),
        actor=DAEMON,
    )
    return Cluster(slurm, nodes, deps)


def run(session: Session, fleet: Cluster, *nodes: str, act: bool = True) -> dict[str, SweptNode]:
    targets = [SweepTarget(node, CheckTrigger.SCHEDULE) for node in nodes]
    return {swept.judgement.node: swept for swept in sweep(session, fleet.deps, targets, act=act)}


def events(session: Session, node: str) -> list[NodeEvent]:
    return list(
        session.scalars(select(NodeEvent).where(NodeEvent.node == node).order_by(NodeEvent.id))
    )


def actions(session: Session, node: str) -> list[Action]:
    return list(session.scalars(select(Action).where(Action.node == node).order_by(Action.id)))


def running(job_id: int, node: str) -> SlurmJob:
    job = ended_job(job_id, end=datetime.now(UTC), nodes=(node,), state=JobState.RUNNING)
    return replace(job, end_time=None)


def test_a_faulty_node_is_drained_on_the_record(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-01": "remap-failure", "gpu-02": "healthy"})
    swept = run(db_session, fleet, "gpu-01", "gpu-02")

    faulty = swept["gpu-01"]
    assert faulty.judgement.health is ProbeVerdict.FAULTY
    assert faulty.decision.kind is NodeDecisionKind.DRAIN_NOW
    assert faulty.done == "drained"
    [(node, reason)] = fleet.slurm.drained
    assert node == "gpu-01"
    assert reason.startswith("medic: sweep: GPU 5 (00000000:90:00.0): row remapping failure")
    assert fleet.slurm.states["gpu-01"].drained_by_medic

    [action] = actions(db_session, "gpu-01")
    assert (action.kind, action.result) == (ActionKind.DRAIN.value, ActionResult.SUCCEEDED.value)
    assert action.argv[-1] == f"Reason={reason}"
    [event] = events(db_session, "gpu-01")
    assert (event.kind, event.by_medic, event.reason) == (NodeEventKind.DRAIN.value, True, reason)
    assert (event.actor_name, event.finding) == ("slurm-medic", FindingKind.REMAP_FAILURE.value)
    assert (event.action_id, event.check_id) == (action.id, faulty.check_id)

    check = db_session.get(NodeCheck, faulty.check_id)
    assert check is not None
    assert (check.node, check.trigger, check.health) == ("gpu-01", "schedule", "faulty")
    assert check.decision == NodeDecisionKind.DRAIN_NOW.value
    assert ",remap_failure," in check.kinds
    assert check.actor_name == "slurm-medic"
    assert (check.gpus_seen, check.gpus_expected) == (8, 8)

    healthy = swept["gpu-02"]
    assert (healthy.decision.kind, healthy.done) == (NodeDecisionKind.RECORD, None)
    assert events(db_session, "gpu-02") == []


def test_a_pending_remap_under_a_running_job_drains_after_it(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-03": "row-remap-pending"})
    fleet.slurm.running.append(running(501, "gpu-03"))
    swept = run(db_session, fleet, "gpu-03")["gpu-03"]

    assert swept.judgement.running_jobs == (501,)
    assert swept.decision.kind is NodeDecisionKind.DRAIN_AFTER_JOB
    assert swept.decision.reason == "remap_pending: drained after job(s) 501 end"
    assert swept.done == "drained"
    [(_, reason)] = fleet.slurm.drained
    assert reason.startswith("medic: sweep: GPU 2 (00000000:47:00.0): row remap pending")
    [event] = events(db_session, "gpu-03")
    assert event.finding == FindingKind.REMAP_PENDING.value
    check = db_session.get(NodeCheck, swept.check_id)
    assert check is not None
    assert (check.decision, check.running_jobs) == ("drain_after_job", [501])


def test_without_act_a_drain_is_recorded_as_held(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-01": "xid79"})
    swept = run(db_session, fleet, "gpu-01", act=False)["gpu-01"]
    assert swept.decision.kind is NodeDecisionKind.HELD
    assert swept.decision.reason == (
        "would drain_now (fallen_off_bus: drained now); not asked to drain"
    )
    assert swept.done is None
    assert fleet.slurm.drained == []
    assert actions(db_session, "gpu-01") == []
    assert events(db_session, "gpu-01") == []
    check = db_session.get(NodeCheck, swept.check_id)
    assert check is not None
    assert (check.decision, check.decision_reason) == ("held", swept.decision.reason)


def test_the_breaker_counts_an_incidents_drain_with_the_sweeps(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    control.record_node_event(
        db_session,
        node="gpu-09",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: XID 79 killed job 77",
    )
    fleet = cluster(
        probe_settings,
        {"gpu-01": "remap-failure", "gpu-02": "ecc-uncorrectable", "gpu-03": "xid79"},
    )
    swept = run(db_session, fleet, "gpu-01", "gpu-02", "gpu-03")
    assert swept["gpu-01"].done == "drained"
    for node in ("gpu-02", "gpu-03"):
        assert swept[node].decision.kind is NodeDecisionKind.HELD
        assert swept[node].decision.reason == (
            "drain circuit breaker: 2 drain(s) in the last hour (limit 2); not draining"
        )
        assert events(db_session, node) == []
    assert [node for node, _ in fleet.slurm.drained] == ["gpu-01"]


def test_the_breaker_forgets_drains_older_than_an_hour_and_never_counts_a_cordon(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    control.record_node_event(
        db_session,
        node="gpu-08",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: XID 79 killed job 70",
        occurred_at=datetime.now(UTC) - timedelta(hours=2),
    )
    control.record_node_event(
        db_session,
        node="gpu-09",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: cordon by alice: fan noise",
        actor_name="alice",
        finding=CORDON_FINDING,
    )
    fleet = cluster(probe_settings, {"gpu-01": "remap-failure", "gpu-02": "gpu-missing"})
    swept = run(db_session, fleet, "gpu-01", "gpu-02")
    assert [swept[node].done for node in ("gpu-01", "gpu-02")] == ["drained", "drained"]
    assert swept["gpu-02"].decision.finding is FindingKind.GPU_MISSING


def test_someone_elses_drain_is_left_as_it_is(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-01": "remap-failure"})
    fleet.slurm.states["gpu-01"] = replace(
        gpu_node("gpu-01"), flags=frozenset({"DRAIN"}), reason="RMA 5512", reason_user="root"
    )
    swept = run(db_session, fleet, "gpu-01")["gpu-01"]
    assert swept.decision.kind is NodeDecisionKind.DRAINED_BY_OTHER
    assert fleet.slurm.drained == []
    assert events(db_session, "gpu-01") == []


def test_a_drain_slurm_refuses_leaves_a_failed_action_and_no_event(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-01": "remap-failure"})
    fleet.slurm.refuse_drain = True
    swept = run(db_session, fleet, "gpu-01")["gpu-01"]
    assert swept.done == "not drained: gpu-01 is drained by someone else"
    [action] = actions(db_session, "gpu-01")
    assert action.result == ActionResult.FAILED.value
    assert events(db_session, "gpu-01") == []


def test_an_unreachable_node_is_recorded_never_drained(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-01": "garbage"})
    swept = run(db_session, fleet, "gpu-01", "gpu-02")
    for node in ("gpu-01", "gpu-02"):
        assert swept[node].judgement.health is ProbeVerdict.UNREACHABLE
        assert swept[node].decision.kind is NodeDecisionKind.RECORD
    assert swept["gpu-02"].judgement.deciding == "not probed: gpu-02: connection refused"
    assert fleet.slurm.drained == []


AUTO_RESUME = SweepSettings(auto_resume=True, resume_after_healthy=3)


def test_a_pending_remap_drain_returns_after_three_healthy_sweeps(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-04": "row-remap-pending"}, sweep_settings=AUTO_RESUME)
    assert run(db_session, fleet, "gpu-04")["gpu-04"].done == "drained"
    fleet.nodes.states["gpu-04"] = "healthy"  # the GPU reset applied the remap
    decisions = []
    for _ in range(3):
        swept = run(db_session, fleet, "gpu-04")["gpu-04"]
        decisions.append((swept.decision.kind, swept.done))
    assert decisions == [
        (NodeDecisionKind.KEEP_DRAINED, None),
        (NodeDecisionKind.KEEP_DRAINED, None),
        (NodeDecisionKind.RESUME, "resumed"),
    ]
    assert fleet.slurm.resumed == ["gpu-04"]
    drain, resume = events(db_session, "gpu-04")
    assert (resume.kind, resume.by_medic, resume.actor_name) == (
        NodeEventKind.RESUME.value,
        True,
        "slurm-medic",
    )
    assert resume.reason == (
        "the pending remap was applied and 3 sweeps in a row found the node healthy"
    )
    assert resume.check_id == swept.check_id
    assert drain.finding == FindingKind.REMAP_PENDING.value
    [_, resume_action] = actions(db_session, "gpu-04")
    assert resume_action.kind == ActionKind.RESUME.value
    check = db_session.get(NodeCheck, swept.check_id)
    assert check is not None
    assert check.decision == NodeDecisionKind.RESUME.value


def test_a_faulty_sweep_restarts_the_count(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-04": "row-remap-pending"}, sweep_settings=AUTO_RESUME)
    run(db_session, fleet, "gpu-04")
    reasons = []
    for state in ("healthy", "healthy", "row-remap-pending", "healthy", "healthy"):
        fleet.nodes.states["gpu-04"] = state
        swept = run(db_session, fleet, "gpu-04")["gpu-04"]
        assert swept.decision.kind is NodeDecisionKind.KEEP_DRAINED
        reasons.append(swept.decision.reason.split(" (latest")[0])
    assert reasons == [
        "1 of 3 healthy sweeps in a row since the drain",
        "2 of 3 healthy sweeps in a row since the drain",
        "0 of 3 healthy sweeps in a row since the drain",
        "1 of 3 healthy sweeps in a row since the drain",
        "2 of 3 healthy sweeps in a row since the drain",
    ]
    assert fleet.slurm.resumed == []


def test_without_act_a_resume_is_decided_but_not_done(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    one = SweepSettings(auto_resume=True, resume_after_healthy=1)
    fleet = cluster(probe_settings, {"gpu-04": "row-remap-pending"}, sweep_settings=one)
    run(db_session, fleet, "gpu-04")
    fleet.nodes.states["gpu-04"] = "healthy"
    swept = run(db_session, fleet, "gpu-04", act=False)["gpu-04"]
    assert (swept.decision.kind, swept.done) == (NodeDecisionKind.RESUME, None)
    assert fleet.slurm.resumed == []


def test_a_cordon_stays_drained_however_healthy_the_node(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-05": "healthy"}, sweep_settings=AUTO_RESUME)
    reason = "medic: cordon by alice: fan noise"
    fleet.slurm.states["gpu-05"] = replace(
        gpu_node("gpu-05"), flags=frozenset({"DRAIN"}), reason=reason, reason_user="slurm"
    )
    control.record_node_event(
        db_session,
        node="gpu-05",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason=reason,
        actor_name="alice",
        finding=CORDON_FINDING,
    )
    for _ in range(4):
        swept = run(db_session, fleet, "gpu-05")["gpu-05"]
        assert swept.judgement.health is ProbeVerdict.HEALTHY
        assert swept.decision.kind is NodeDecisionKind.KEEP_DRAINED
        assert swept.decision.reason == "a person's cordon: only an admin resumes it"
    assert fleet.slurm.resumed == []
    assert len(events(db_session, "gpu-05")) == 1


def test_an_incidents_drain_stays_for_an_admin(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-06": "healthy"}, sweep_settings=AUTO_RESUME)
    reason = "medic: XID 79 killed job 77"
    fleet.slurm.states["gpu-06"] = replace(
        gpu_node("gpu-06"), flags=frozenset({"DRAIN"}), reason=reason, reason_user="slurm"
    )
    control.record_node_event(
        db_session, node="gpu-06", kind=NodeEventKind.DRAIN, by_medic=True, reason=reason
    )
    for _ in range(4):
        swept = run(db_session, fleet, "gpu-06")["gpu-06"]
    assert swept.decision.kind is NodeDecisionKind.KEEP_DRAINED
    assert swept.decision.reason.startswith("drained for an incident")
    assert fleet.slurm.resumed == []


def test_a_node_resumed_by_hand_is_drained_again_when_still_faulty(
    db_session: Session, probe_settings: ProbeSettings
) -> None:
    fleet = cluster(probe_settings, {"gpu-07": "remap-failure"})
    run(db_session, fleet, "gpu-07")
    fleet.slurm.states["gpu-07"] = gpu_node("gpu-07")  # `scontrol update state=resume`
    swept = run(db_session, fleet, "gpu-07")["gpu-07"]
    assert (swept.decision.kind, swept.done) == (NodeDecisionKind.DRAIN_NOW, "drained")
    assert len(fleet.slurm.drained) == 2


def test_sweep_nodes_are_the_hostlists_else_every_gpu_node() -> None:
    nodes = [
        gpu_node("gpu-01"),
        replace(gpu_node("cpu-01"), gres=None),
        replace(gpu_node("gpu-02"), gres="gpu:h100:8(S:0,1),shard:h100:16"),
        replace(gpu_node("mps-01"), gres="mps:100"),
    ]
    assert sweep_nodes(nodes, None) == ["gpu-01", "gpu-02"]
    assert sweep_nodes(nodes, "gpu-[02-03]") == ["gpu-02", "gpu-03"]


def test_running_jobs_are_listed_by_node() -> None:
    first = replace(running(11, "gpu-01"), nodes=("gpu-01", "gpu-02"))
    assert running_by_node([first, running(12, "gpu-02")]) == {
        "gpu-01": (11,),
        "gpu-02": (11, 12),
    }
