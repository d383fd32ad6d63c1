"""The admin's fleet commands on a real record (SQLite and PostgreSQL): `sweep`, `nodes`,
`nodes drain`, `nodes resume`, `nodes history` and `show NODE`.

Only the seams are fakes: Slurm (`FakeSlurm`, whose drain and resume keep each node's state
and refuse a drain someone else set, as `SlurmCli` does) and the prober's fetch, which hands
back real documents made by running the node probe (daemon/installable/node_probe.py) on the
dev cluster's node states (the fixture nvidia-smi and dmesg)."""

from __future__ import annotations

import json
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, select

from daemon.cli import main
from daemon.commands import sweep as fleet_commands
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.prober import NodeProber, ProbeSettings, RawProbe
from daemon.evidence.records import Evidence
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import OperationRefused
from daemon.slurm.records import JobState, JobWindow, NodeBaseState, QueuedJob, SlurmJob, SlurmNode
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.engine import make_session_factory
from daemon.store.models import AuditEvent, NodeCheck, NodeEvent, NodeEventKind
from daemon.store.schema import upgrade
from tests.factories import ended_job
from tests.test_probe import run_probe_program

# The CLI as root, the admin who sweeps, drains and resumes: the `root` mark.
pytestmark = pytest.mark.root

ALICE_UID = 1001
STATES = ("healthy", "row-remap-pending", "remap-failure", "cotenant", "gpu-missing", "xid79")
FLEET = "gpu-[01-04]"


@pytest.fixture(scope="module")
def documents() -> dict[str, str]:
    """Each node state's probe document, as the probe program prints it on a node."""
    return {state: run_probe_program(state) for state in STATES}


@dataclass
class FakeSlurm:
    """Slurm's nodes and running jobs; drain and resume change a node as slurmctld would and
    refuse another's drain as `SlurmCli` does."""

    nodes_by_name: dict[str, SlurmNode]
    running: tuple[SlurmJob, ...] = ()
    drained: list[tuple[str, str]] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> tuple[SlurmJob, ...]:
        return ()

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> JobWindow:
        return JobWindow(())

    def running_jobs(self, *, users: Iterable[str] = ()) -> tuple[SlurmJob, ...]:
        return self.running

    def job(self, job_id: int | str) -> SlurmJob:
        raise AssertionError("not asked for by the fleet commands")

    def jobs(self, job_ids: Iterable[int]) -> tuple[SlurmJob, ...]:
        raise AssertionError("not asked for by the fleet commands")

    def queued_jobs(self) -> tuple[QueuedJob, ...]:
        return ()

    def accounting_backlog(self) -> int:
        return 0

    def submit(
        self,
        script: str,
        *,
        as_user: str,
        comment: str | None = None,
        exclude_nodes: Iterable[str] = (),
        extra_args: Sequence[str] = (),
        work_dir: str | None = None,
    ) -> int:
        raise AssertionError("the fleet commands submit nothing")

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        raise AssertionError("the fleet commands cancel nothing")

    def drain(self, node: str, reason: str) -> None:
        current = self.nodes_by_name[node]
        if current.is_drained and not current.drained_by_medic:
            raise OperationRefused(f"{node} is already drained by {current.reason_user}")
        self.nodes_by_name[node] = replace(
            current, flags=frozenset({"DRAIN"}), reason=reason, reason_user="root"
        )
        self.drained.append((node, reason))

    def resume(self, node: str) -> None:
        current = self.nodes_by_name[node]
        if not current.drained_by_medic:
            raise OperationRefused(f"{node}'s reason {current.reason!r} was not set by slurm-medic")
        self.nodes_by_name[node] = replace(current, flags=frozenset(), reason=None)
        self.resumed.append(node)

    def node(self, name: str) -> SlurmNode:
        return self.nodes_by_name[name]

    def nodes(self) -> tuple[SlurmNode, ...]:
        return tuple(self.nodes_by_name.values())


def gpu_node(name: str, *, reason: str | None = None, by: str | None = None) -> SlurmNode:
    return SlurmNode(
        name=name,
        address=None,
        state=NodeBaseState.IDLE,
        flags=frozenset({"DRAIN"}) if reason else frozenset(),
        reason=reason,
        reason_user=by,
        reason_time=None,
        gres="gpu:a100:8",
    )


@dataclass
class Fleet:
    """The record, the config, and what each node's probe shows (a state, or None: no answer)."""

    engine: Engine
    config: Path
    slurm: FakeSlurm
    states: dict[str, str | None]
    fetched: list[str] = field(default_factory=list)

    def write_config(
        self, *, admin_groups: Sequence[str] = (), probe: bool = True, max_drains: int = 2
    ) -> None:
        groups = ", ".join(f'"{group}"' for group in admin_groups)
        url = self.engine.url.render_as_string(hide_password=False)
        text = f'[store]\nurl = "{url}"\n\n[policy]\nadmin_groups = [{groups}]\n'
        text += f"max_drains_per_hour = {max_drains}\n"
        if probe:
            key, known = self.config.parent / "key", self.config.parent / "known_hosts"
            text += f'\n[probe]\nkey_path = "{key}"\nknown_hosts_path = "{known}"\n'
        self.config.write_text(text)

    def cli(self, *args: str, sudo_uid: int | None = None) -> Result:
        """As root with `--config`, or as sudo runs it for `sudo_uid` (the system config)."""
        env = {"COLUMNS": "400", "SUDO_UID": "" if sudo_uid is None else str(sudo_uid)}
        if sudo_uid is None:
            return CliRunner().invoke(main, [*args, "--config", str(self.config)], env=env)
        with mock.patch("daemon.config.DEFAULT_CONFIG_PATH", self.config):
            return CliRunner().invoke(main, list(args), env=env)

    def rows(self, model: Any) -> list[Any]:
        with make_session_factory(self.engine)() as session:
            return list(session.scalars(select(model).order_by(model.id)))


@pytest.fixture
def fleet(
    empty_db_engine: Engine,
    tmp_path: Path,
    documents: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> Fleet:
    upgrade(empty_db_engine)
    (tmp_path / "key").write_text("key")
    (tmp_path / "known_hosts").write_text("")
    slurm = FakeSlurm({name: gpu_node(name) for name in ("gpu-01", "gpu-02", "gpu-03", "gpu-04")})
    fleet = Fleet(
        empty_db_engine,
        tmp_path / "config.toml",
        slurm,
        {"gpu-01": "healthy", "gpu-02": "row-remap-pending", "gpu-03": "cotenant"},
    )
    fleet.states["gpu-04"] = "remap-failure"
    fleet.write_config()

    def fetch(node: str) -> RawProbe:
        fleet.fetched.append(node)
        state = fleet.states.get(node)
        now = datetime.now(UTC)
        if state is None:
            return RawProbe(node, now, None, f"{node}: connection refused (no sshd listening)")
        return RawProbe(node, now, documents[state])

    def prober(settings: ProbeSettings) -> NodeProber:
        return NodeProber(settings, fetch=fetch)

    def backend(_context: object) -> SlurmBackend:
        return slurm  # mypy holds FakeSlurm to the backend's protocol here

    monkeypatch.setattr(fleet_commands, "slurm_backend", backend)
    monkeypatch.setattr(fleet_commands, "node_prober", prober)
    return fleet


def _json(result: Result, exit_code: int = 0) -> Any:
    assert result.exit_code == exit_code, result.output
    return json.loads(result.output)


def _audit(fleet: Fleet, verb: str) -> list[AuditEvent]:
    return [event for event in fleet.rows(AuditEvent) if event.verb == verb]


def _admin_group_of_nobody() -> tuple[int, str]:
    import grp

    nobody = pwd.getpwnam("nobody")
    return nobody.pw_uid, grp.getgrgid(nobody.pw_gid).gr_name


# ---------------------------------------------------------------- sweep


def test_sweep_names_each_node_health_and_why_and_drains_nothing(fleet: Fleet) -> None:
    result = fleet.cli("sweep", FLEET)
    assert result.exit_code == 1, result.output  # a faulty node, as `probe`
    lines = {
        line.split("│")[1].strip(): line for line in result.output.splitlines() if "gpu-0" in line
    }
    assert "healthy" in lines["gpu-01"]
    assert "GPU 2 (00000000:47:00.0): row remap pending" in lines["gpu-02"]
    assert "held: would drain_after_job" in lines["gpu-02"]
    assert "degraded" in lines["gpu-03"]
    assert "pid 31337 (python3) holds 30.00 GiB outside any job" in lines["gpu-03"]
    assert "record: policy drains for none of: cotenant" in lines["gpu-03"]
    assert "GPU 5 (00000000:90:00.0): row remapping failure occurred" in lines["gpu-04"]
    assert "held: would drain_now" in lines["gpu-04"]
    assert "1 healthy, 1 degraded, 2 faulty, 0 unreachable" in result.output
    assert fleet.slurm.drained == []
    checks = fleet.rows(NodeCheck)
    assert [(c.node, c.trigger, c.health, c.actor_name) for c in checks] == [
        ("gpu-01", "command", "healthy", "root"),
        ("gpu-02", "command", "faulty", "root"),
        ("gpu-03", "command", "degraded", "root"),
        ("gpu-04", "command", "faulty", "root"),
    ]


def test_a_piped_sweep_keeps_each_node_on_one_line(fleet: Fleet) -> None:
    """Rich would wrap the table to 80 columns off a terminal; `grep gpu-02` must find it all."""
    env = {"COLUMNS": "80", "SUDO_UID": ""}
    result = CliRunner().invoke(main, ["sweep", FLEET, "--config", str(fleet.config)], env=env)
    (line,) = [line for line in result.output.splitlines() if "gpu-02" in line]
    assert "needs a GPU reset" in line
    assert "not asked to drain" in line


def test_sweep_json_is_one_document_with_every_finding(fleet: Fleet) -> None:
    fleet.slurm.running = (
        ended_job(77, state=JobState.RUNNING, end=datetime.now(UTC), nodes=("gpu-02",)),
    )
    document = _json(fleet.cli("sweep", "gpu-[02,04]", "--json"), exit_code=1)
    assert document["summary"] == {"healthy": 0, "degraded": 0, "faulty": 2, "unreachable": 0}
    remap, failure = document["nodes"]
    assert remap["node"] == "gpu-02"
    assert [f["kind"] for f in remap["findings"]] == ["remap_pending", "ecc_correctable"]
    assert remap["findings"][0]["gpu"] == 2
    assert (remap["gpus_seen"], remap["gpus_expected"], remap["running_jobs"]) == (8, 8, [77])
    assert remap["decision"] == "held"
    assert remap["decision_reason"].startswith("would drain_after_job (remap_pending: drained")
    assert remap["done"] is None
    assert {f["kind"] for f in failure["findings"]} >= {"remap_failure", "xid_hardware"}
    checks = fleet.rows(NodeCheck)
    assert [remap["check"], failure["check"]] == [check.id for check in checks]
    assert checks[0].decision == "held"


@pytest.mark.parametrize(
    ("states", "exit_code", "summary"),
    [
        ({"gpu-01": "healthy", "gpu-03": "cotenant"}, 0, "1 healthy, 1 degraded, 0 faulty"),
        ({"gpu-01": "healthy", "gpu-03": None}, 3, "1 healthy, 0 degraded, 0 faulty, 1 unreach"),
        ({"gpu-01": "gpu-missing", "gpu-03": None}, 1, "0 healthy, 0 degraded, 1 faulty, 1 unre"),
    ],
)
def test_sweep_exit_code_is_the_worst_health(
    fleet: Fleet, states: dict[str, str | None], exit_code: int, summary: str
) -> None:
    fleet.states.update(states)
    result = fleet.cli("sweep", "gpu-[01,03]")
    assert result.exit_code == exit_code, result.output
    assert summary in result.output


def test_sweep_without_a_nodeset_covers_sweep_nodes_else_every_gpu_node(fleet: Fleet) -> None:
    fleet.slurm.nodes_by_name["login-01"] = replace(gpu_node("login-01"), gres=None)
    fleet.cli("sweep", "--json")
    assert sorted(fleet.fetched) == ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]
    fleet.fetched.clear()
    fleet.config.write_text(fleet.config.read_text() + '\n[sweep]\nnodes = "gpu-[01,03]"\n')
    document = _json(fleet.cli("sweep", "--json"))
    assert [row["node"] for row in document["nodes"]] == ["gpu-01", "gpu-03"]


def test_sweep_drain_drains_as_policy_says(fleet: Fleet) -> None:
    fleet.slurm.running = (
        ended_job(77, state=JobState.RUNNING, end=datetime.now(UTC), nodes=("gpu-02",)),
    )
    document = _json(fleet.cli("sweep", FLEET, "--drain", "--json"), exit_code=1)
    decided = {row["node"]: (row["decision"], row["done"]) for row in document["nodes"]}
    assert decided == {
        "gpu-01": ("record", None),
        "gpu-02": ("drain_after_job", "drained"),
        "gpu-03": ("record", None),
        "gpu-04": ("drain_now", "drained"),
    }
    assert [node for node, _ in fleet.slurm.drained] == ["gpu-02", "gpu-04"]
    reasons = [reason for _, reason in fleet.slurm.drained]
    assert reasons[0].startswith("medic: sweep: GPU 2 (00000000:47:00.0): row remap pending")
    assert reasons[1].startswith("medic: sweep: GPU 5 (00000000:90:00.0): row remapping failure")
    events = fleet.rows(NodeEvent)
    assert [(e.node, e.finding, e.actor_name) for e in events] == [
        ("gpu-02", "remap_pending", "root"),
        ("gpu-04", "remap_failure", "root"),
    ]
    assert [e.check_id for e in events] == [
        document["nodes"][1]["check"],
        document["nodes"][3]["check"],
    ]


def test_sweep_drain_respects_the_breaker_which_leaves_cordons_out(fleet: Fleet) -> None:
    with make_session_factory(fleet.engine)() as session:
        control.record_node_event(
            session, node="gpu-09", kind=NodeEventKind.DRAIN, by_medic=True, reason="medic: XID 79"
        )
        control.record_node_event(
            session,
            node="gpu-08",
            kind=NodeEventKind.DRAIN,
            by_medic=True,
            reason="medic: cordon by root: bios",
            finding="cordon",
        )
        session.commit()
    document = _json(fleet.cli("sweep", "gpu-[02,04]", "--drain", "--json"), exit_code=1)
    first, second = document["nodes"]
    assert (first["decision"], first["done"]) == ("drain_after_job", "drained")
    assert second["decision"] == "held"
    assert second["decision_reason"].startswith(
        "drain circuit breaker: 2 drain(s) in the last hour"
    )
    assert fleet.slurm.drained == [("gpu-02", fleet.slurm.nodes_by_name["gpu-02"].reason)]


@pytest.mark.users
def test_a_non_admin_may_not_sweep_and_the_attempt_is_recorded(fleet: Fleet) -> None:
    result = fleet.cli("sweep", FLEET, "--drain", sudo_uid=ALICE_UID)
    assert result.exit_code == 3
    assert "alice may not sweep nodes" in result.output
    assert fleet.fetched == []
    assert fleet.rows(NodeCheck) == []
    refused = _audit(fleet, "sweep_refused")
    assert [(e.actor_name, e.subject_id, e.details["drain"]) for e in refused] == [
        ("alice", FLEET, True)
    ]


def test_an_admin_group_member_may_sweep(fleet: Fleet) -> None:
    uid, group = _admin_group_of_nobody()
    fleet.write_config(admin_groups=(group,))
    document = _json(fleet.cli("sweep", "gpu-01", "--json", sudo_uid=uid))
    assert document["nodes"][0]["health"] == "healthy"
    assert fleet.rows(NodeCheck)[0].actor_name == "nobody"


def test_sweep_needs_probe_settings_and_a_valid_nodeset(fleet: Fleet) -> None:
    fleet.write_config(probe=False)
    result = fleet.cli("sweep", FLEET)
    assert result.exit_code == 2
    assert "needs the config's [probe] section" in result.output
    fleet.write_config()
    for bad in ("gpu-[01-", "gpu-01;reboot", "none"):
        assert fleet.cli("sweep", bad).exit_code == 2, bad
    assert fleet.fetched == []


# ---------------------------------------------------------------- nodes drain and resume


def test_a_cordon_is_on_the_record_with_who_why_and_the_probe(fleet: Fleet) -> None:
    document = _json(fleet.cli("nodes", "drain", "gpu-02", "--reason", "bad DIMM", "--json"))
    reason = "medic: cordon by root: bad DIMM"
    assert document["reason"] == reason
    (row,) = document["nodes"]
    assert (row["node"], row["done"], row["health"]) == ("gpu-02", "drained", "faulty")
    assert fleet.slurm.drained == [("gpu-02", reason)]
    (check,) = fleet.rows(NodeCheck)
    assert (check.id, check.trigger, check.actor_name) == (row["check"], "cordon", "root")
    assert check.decision == "held"  # the probe alone drains nothing
    (event,) = fleet.rows(NodeEvent)
    assert (event.kind, event.reason, event.actor_name, event.finding, event.check_id) == (
        "drain",
        reason,
        "root",
        "cordon",
        check.id,
    )
    (audit,) = _audit(fleet, "node_drain")
    assert (audit.actor_name, audit.subject_id) == ("root", "gpu-02")
    assert audit.details == {"why": "bad DIMM", "grounds": "root", "check": check.id}
    text = fleet.cli("nodes", "drain", "gpu-01", "--reason", "fan")
    assert text.exit_code == 0, text.output
    assert "gpu-01 drained; probe healthy: 8 GPUs of 8" in text.output


def test_a_cordon_never_overwrites_someone_elses_drain(fleet: Fleet) -> None:
    fleet.slurm.nodes_by_name["gpu-01"] = gpu_node("gpu-01", reason="ops: bios update", by="ops")
    result = fleet.cli("nodes", "drain", "gpu-[01-02]", "--reason", "maintenance", "--json")
    document = _json(result, exit_code=1)
    done = {row["node"]: row["done"] for row in document["nodes"]}
    assert done["gpu-01"].startswith("not drained: gpu-01 is already drained by ops")
    assert done["gpu-02"] == "drained"
    assert fleet.slurm.nodes_by_name["gpu-01"].reason == "ops: bios update"
    assert [event.node for event in fleet.rows(NodeEvent)] == ["gpu-02"]


def test_a_cordon_without_probe_settings_says_it_was_not_probed(fleet: Fleet) -> None:
    fleet.write_config(probe=False)
    document = _json(fleet.cli("nodes", "drain", "gpu-03", "--reason", "noisy", "--json"))
    assert document["nodes"][0]["deciding"] == "not probed: no [probe] settings"
    assert document["nodes"][0]["check"] is None
    (event,) = fleet.rows(NodeEvent)
    assert (event.finding, event.check_id) == ("cordon", None)
    assert fleet.fetched == []


@pytest.mark.users
def test_a_non_admin_may_not_cordon_and_the_attempt_is_recorded(fleet: Fleet) -> None:
    result = fleet.cli("nodes", "drain", "gpu-02", "--reason", "mine now", sudo_uid=ALICE_UID)
    assert result.exit_code == 3
    assert "alice may not drain nodes" in result.output
    assert fleet.slurm.drained == []
    assert fleet.rows(NodeEvent) == []
    refused = _audit(fleet, "node_drain_refused")
    assert [(e.actor_name, e.subject_id, e.details["why"]) for e in refused] == [
        ("alice", "gpu-02", "mine now")
    ]
    assert fleet.cli("nodes", "drain", "gpu-02", "--reason", " ").exit_code == 2


def test_a_cordon_does_not_count_against_the_breaker(fleet: Fleet) -> None:
    fleet.write_config(max_drains=1)
    assert fleet.cli("nodes", "drain", "gpu-01", "--reason", "fan").exit_code == 0
    document = _json(fleet.cli("sweep", "gpu-04", "--drain", "--json"), exit_code=1)
    assert document["nodes"][0]["done"] == "drained"


def test_resume_a_set_records_who_and_the_probe(fleet: Fleet) -> None:
    fleet.states["gpu-02"] = "healthy"
    assert fleet.cli("nodes", "drain", "gpu-[01-02]", "--reason", "fan").exit_code == 0
    document = _json(fleet.cli("nodes", "resume", "gpu-[01-02]", "--why", "fixed", "--json"))
    assert [row["done"] for row in document["nodes"]] == ["resumed", "resumed"]
    assert fleet.slurm.resumed == ["gpu-01", "gpu-02"]
    resumes = [event for event in fleet.rows(NodeEvent) if event.kind == "resume"]
    checks = {check.id: check for check in fleet.rows(NodeCheck)}
    assert [(e.reason, e.actor_name) for e in resumes] == [("resumed by root: fixed", "root")] * 2
    assert [checks[e.check_id].trigger for e in resumes if e.check_id is not None] == [
        "cordon",
        "cordon",
    ]
    assert fleet.cli("nodes", "resume", "gpu-01").exit_code == 3  # no drain in force now


def test_resume_refuses_a_drain_someone_else_rewrote(fleet: Fleet) -> None:
    assert fleet.cli("nodes", "drain", "gpu-01", "--reason", "fan").exit_code == 0
    fleet.slurm.nodes_by_name["gpu-01"] = gpu_node("gpu-01", reason="ops: bios", by="ops")
    result = fleet.cli("nodes", "resume", "gpu-01")
    assert result.exit_code == 1
    assert "not set by slurm-medic" in result.output
    assert fleet.slurm.resumed == []


# ---------------------------------------------------------------- nodes and its history


def test_nodes_lists_every_known_node_with_its_last_probe_and_drain(fleet: Fleet) -> None:
    fleet.cli("sweep", "gpu-[01-02]")
    fleet.cli("nodes", "drain", "gpu-02", "--reason", "bad DIMM")
    with make_session_factory(fleet.engine)() as session:
        control.record_node_event(
            session, node="gpu-07", kind=NodeEventKind.DRAIN, by_medic=False, reason="ops"
        )
        session.commit()
    document = _json(fleet.cli("nodes", "--json"))
    rows = {row["node"]: row for row in document["nodes"]}
    assert sorted(rows) == ["gpu-01", "gpu-02", "gpu-07"]
    assert rows["gpu-01"]["last_check"]["trigger"] == "command"
    assert rows["gpu-01"]["drain"] is None
    assert rows["gpu-02"]["last_check"]["trigger"] == "cordon"
    assert rows["gpu-02"]["last_check"]["deciding"].startswith("GPU 2 (00000000:47:00.0)")
    drain = rows["gpu-02"]["drain"]
    assert (drain["by"], drain["finding"], drain["check"]) == (
        "root",
        "cordon",
        rows["gpu-02"]["last_check"]["check"],
    )
    assert rows["gpu-07"]["last_check"] is None
    assert [row["node"] for row in document["drains"]] == ["gpu-02"]  # the old key, kept
    text = fleet.cli("nodes").output
    assert "medic: cordon by root: bad DIMM (by root at" in text
    assert "never probed" in text


def test_history_names_the_node_and_the_job_that_died_before_its_drain(fleet: Fleet) -> None:
    now = datetime.now(UTC)
    with make_session_factory(fleet.engine)() as session:
        repo.record_job(
            session, job=ended_job(3001, end=now - timedelta(minutes=5), nodes=("gpu-02",))
        )
        repo.record_job(
            session, job=ended_job(3002, end=now - timedelta(minutes=4), nodes=("gpu-01",))
        )
        session.commit()
    fleet.cli("sweep", "gpu-02")
    fleet.cli("sweep", "gpu-02", "--drain")
    with make_session_factory(fleet.engine)() as session:
        repo.record_job(
            session, job=ended_job(3003, user="bob", end=datetime.now(UTC), nodes=("gpu-02",))
        )
        session.commit()
    document = _json(fleet.cli("nodes", "history", "--finding", "remap_pending", "--json"))
    (row,) = document["nodes"]
    assert (row["node"], row["checks"]) == ("gpu-02", 2)
    assert row["drain_reason"].startswith("medic: sweep: GPU 2 (00000000:47:00.0): row remap")
    assert [(job["job"], job["user"], job["state"]) for job in row["jobs_died"]] == [
        (3001, "alice", "FAILED")
    ]
    text = fleet.cli("nodes", "history", "--finding", "remap_pending").output
    assert "3001 alice FAILED" in text
    assert "3003" not in text
    later = (now + timedelta(days=1)).date().isoformat()
    empty = _json(
        fleet.cli(
            "nodes",
            "history",
            "--finding",
            "remap_pending",
            "--since",
            later,
            "--until",
            later + "T12:00",
            "--json",
        )
    )
    assert empty["nodes"] == []
    assert _json(fleet.cli("nodes", "history", "--finding", "gpu_missing", "--json"))["nodes"] == []
    assert fleet.cli("nodes", "history", "--finding", "bad_luck").exit_code == 2
    assert (
        fleet.cli("nodes", "history", "--finding", "remap_pending", "--since", "May").exit_code == 2
    )


# ---------------------------------------------------------------- show NODE


def test_show_node_tells_its_story_in_order(fleet: Fleet) -> None:
    with make_session_factory(fleet.engine)() as session:
        job = ended_job(4001, end=datetime.now(UTC) - timedelta(hours=1), nodes=("gpu-02",))
        repo.record_job(session, job=job)
        repo.record_incident(
            session,
            slurm_job_id=4001,
            evidence=Evidence(job=job),
            diagnosis=Diagnosis(
                kind=FailureKind.HARDWARE,
                confidence=Confidence.HIGH,
                reasons=("XID 63",),
                node="gpu-02",
            ),
        )
        session.commit()
    fleet.cli("sweep", "gpu-02")
    fleet.cli("nodes", "drain", "gpu-02", "--reason", "bad DIMM")
    fleet.cli("nodes", "resume", "gpu-02", "--why", "GPU reset")
    document = _json(fleet.cli("show", "gpu-02", "--json"))
    assert document["node"] == "gpu-02"
    assert [entry["what"] for entry in document["story"]] == [
        "incident",
        "check",
        "check",
        "drain",
        "check",
        "resume",
    ]
    drain = document["story"][3]
    assert (drain["by"], drain["finding"], drain["check"]) == (
        "root",
        "cordon",
        document["story"][2]["check"],
    )
    text = fleet.cli("show", "gpu-02").output
    said = [
        "incident 1: job 4001 of alice died, hardware (high confidence)",
        "(command, by root): faulty: GPU 2 (00000000:47:00.0): row remap pending",
        "drain by root on cordon",
        "resume by root",
        "resumed by root: GPU reset",
    ]
    positions = [text.index(line) for line in said]
    assert positions == sorted(positions)


def test_show_an_unknown_node_or_a_bad_name(fleet: Fleet) -> None:
    missing = fleet.cli("show", "gpu-99")
    assert missing.exit_code == 1
    assert "no node gpu-99 in the record" in missing.output
    assert fleet.cli("show", "gpu 99").exit_code == 2
