"""Prometheus metrics: the record's numbers read at scrape time on a seeded record (SQLite and
PostgreSQL), parsed back from the exposition; an unreadable record is `record_up 0`, never a
failed scrape; the web app and the daemon's listener on a real loopback port; the in-process
series (Slurm command errors, probes, cycles, leadership) and the `[metrics]` settings."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from daemon.config import Settings
from daemon.diagnosis import FailureKind
from daemon.evidence.prober import NodeProber, ProbeSettings, RawProbe
from daemon.metrics import series
from daemon.metrics.record import DaemonLimits
from daemon.metrics.serve import (
    MetricsListenError,
    daemon_registry,
    record_registry,
    serve_metrics,
    web_metrics_app,
)
from daemon.metrics.settings import MetricsSettings
from daemon.process import CommandResult, CommandTimeout
from daemon.slurm.errors import SlurmUnavailable
from daemon.slurm.records import JobState, JobWindow
from daemon.store import action_rows, awaited, control
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import Cursor, LineageStatus, NodeEventKind
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from daemon.store.states import ProposalState
from tests.test_probe import document
from tests.test_service_poll import WindowSlurm, daemon
from tests.test_store import sbatch_argv, seed_incident, seed_proposal

NOW = datetime.now(UTC).replace(microsecond=0)
DAEMON = repo.Actor.daemon()
ALICE = repo.Actor.user("alice", 1001)
BOB = repo.Actor.user("bob", 1002)
# Every label a slurm-medic series may carry: enums and fixed sets, never a job, user or node.
ALLOWED_LABELS = {
    "kind",
    "state",
    "outcome",
    "decider",
    "result",
    "status",
    "watcher",
    "version",
    "le",
    "reason",
    "command",
    "step",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    upgrade(empty_db_engine)
    return empty_db_engine


def scrape(registry: CollectorRegistry) -> tuple[str, Samples]:
    text = generate_latest(registry).decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


@dataclass(frozen=True)
class Seeded:
    """What the seeded record holds that the numbers are checked against."""

    cursor_at: datetime
    names: frozenset[str]  # users, nodes and job ids that must never be a label value


def seed(session: Session) -> Seeded:
    """Five incidents (three true OOMs, fragmentation, hardware), a proposal on each: approved
    by policy and relaunched 3 min after its job ended, rejected by alice, approved by bob,
    expired, still waiting; drains by medic, by someone else, a cordon; two lineages."""
    # The record's own stamps (a submission's `finished_at`) are the real clock's: the seed's
    # times are that clock's too, read now, not when the module was imported minutes before.
    now = datetime.now(UTC).replace(microsecond=0)
    ended = now - timedelta(minutes=3)
    kinds = [
        FailureKind.TRUE_OOM,
        FailureKind.TRUE_OOM,
        FailureKind.TRUE_OOM,
        FailureKind.FRAGMENTATION,
        FailureKind.HARDWARE,
    ]
    proposals = []
    for number, kind in enumerate(kinds):
        incident = seed_incident(session, job_id=7000 + number, kind=kind, at=ended)
        proposals.append(seed_proposal(session, incident_id=incident.id))
    by_policy, rejected, by_person, expired, _waiting = proposals
    repo.transition_proposal(
        session, proposal_id=by_policy.id, to=ProposalState.APPROVED, actor=DAEMON
    )
    intent = action_rows.record_submit_intent(
        session, proposal_id=by_policy.id, build_argv=sbatch_argv, actor=DAEMON
    )
    action_rows.record_submitted(session, intent=intent, slurm_job_id=7100, actor=DAEMON)
    repo.transition_proposal(
        session, proposal_id=rejected.id, to=ProposalState.REJECTED, actor=ALICE, reason="no"
    )
    repo.transition_proposal(
        session, proposal_id=by_person.id, to=ProposalState.APPROVED, actor=BOB
    )
    repo.transition_proposal(
        session, proposal_id=expired.id, to=ProposalState.EXPIRED, actor=DAEMON
    )
    recent = now - timedelta(minutes=10)
    for node, event, by_medic, finding in (
        ("gpu-03", NodeEventKind.DRAIN, True, None),
        ("gpu-04", NodeEventKind.DRAIN, True, None),
        ("gpu-04", NodeEventKind.RESUME, True, None),
        ("gpu-05", NodeEventKind.DRAIN, False, None),
        ("gpu-06", NodeEventKind.DRAIN, True, "cordon"),
    ):
        control.record_node_event(
            session,
            node=node,
            kind=event,
            by_medic=by_medic,
            reason="medic: test",
            occurred_at=recent,
            finding=finding,
        )
    control.record_node_event(
        session,
        node="gpu-07",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: last week",
        occurred_at=now - timedelta(days=7),
    )
    given_up = repo.create_lineage(session, name="llama", owner="alice", template="t")
    repo.create_lineage(session, name="gpt", owner="alice", template="t")
    repo.set_lineage_status(
        session, lineage_id=given_up.id, status=LineageStatus.EXHAUSTED, actor=DAEMON, reason="x"
    )
    control.set_cursor(session, name="finished_jobs", polled_until=now)
    control.set_cursor(session, name="some_future_watcher", polled_until=now)
    session.commit()
    cursor = session.get(Cursor, "finished_jobs")
    assert cursor is not None
    nodes = {f"gpu-0{n}" for n in range(1, 8)}
    jobs = {str(7000 + n) for n in range(5)} | {"7100"}
    return Seeded(cursor.updated_at, frozenset({"alice", "bob", *nodes, *jobs}))


@pytest.fixture
def seeded(fresh_engine: Engine) -> tuple[sessionmaker[Session], Seeded]:
    with make_session_factory(fresh_engine)() as session:
        facts = seed(session)
    return make_session_factory(fresh_engine, read_only=True), facts


def test_the_record_collector_counts_what_the_record_holds(
    seeded: tuple[sessionmaker[Session], Seeded],
) -> None:
    readers, facts = seeded
    text, samples = scrape(record_registry(readers))
    assert value(samples, "slurm_medic_record_up") == 1
    assert value(samples, "slurm_medic_incidents_total", kind="true_oom") == 3
    assert value(samples, "slurm_medic_incidents_total", kind="fragmentation") == 1
    assert value(samples, "slurm_medic_incidents_total", kind="hardware") == 1
    assert value(samples, "slurm_medic_incidents_total", kind="cotenant") == 0
    assert value(samples, "slurm_medic_proposals", state="submitted") == 1
    assert value(samples, "slurm_medic_proposals", state="rejected") == 1
    assert value(samples, "slurm_medic_proposals", state="approved") == 1
    assert value(samples, "slurm_medic_proposals", state="expired") == 1
    assert value(samples, "slurm_medic_proposals", state="proposed") == 1
    decisions = {
        (dict(labels)["outcome"], dict(labels)["decider"]): number
        for (name, labels), number in samples.items()
        if name == "slurm_medic_decisions_total"
    }
    assert decisions == {
        ("approved", "policy"): 1,
        ("approved", "person"): 1,
        ("rejected", "policy"): 0,
        ("rejected", "person"): 1,
        ("expired", "policy"): 1,
    }
    assert value(samples, "slurm_medic_pending_approvals") == 1
    assert 0 <= value(samples, "slurm_medic_pending_approval_oldest_age_seconds") < 3600
    assert value(samples, "slurm_medic_relaunches_total", result="succeeded") == 1
    assert value(samples, "slurm_medic_relaunches_total", result="failed") == 0
    assert value(samples, "slurm_medic_drains_total") == 4  # gpu-03, -04, -06, -07
    assert value(samples, "slurm_medic_drains_last_hour") == 2  # the cordon is a person's
    assert value(samples, "slurm_medic_drained_nodes") == 3  # gpu-03, -06, -07
    assert value(samples, "slurm_medic_lineages", status="exhausted") == 1
    assert value(samples, "slurm_medic_lineages", status="active") == 1
    assert value(samples, "slurm_medic_lineages_given_up") == 1
    assert value(
        samples, "slurm_medic_last_poll_timestamp_seconds", watcher="finished_jobs"
    ) == pytest.approx(facts.cursor_at.timestamp())
    assert not any(
        name == "slurm_medic_last_poll_timestamp_seconds"
        and ("watcher", "some_future_watcher") in labels
        for name, labels in samples
    )
    # The relaunch was submitted about 3 minutes after its job ended.
    assert value(samples, "slurm_medic_relaunch_delay_seconds_bucket", le="120.0") == 0
    assert value(samples, "slurm_medic_relaunch_delay_seconds_bucket", le="300.0") == 1
    assert value(samples, "slurm_medic_relaunch_delay_seconds_bucket", le="+Inf") == 1
    assert value(samples, "slurm_medic_relaunch_delay_seconds_gcount") == 1
    assert 180 <= value(samples, "slurm_medic_relaunch_delay_seconds_gsum") < 300
    assert value(samples, "slurm_medic_build_info", version="0.1.0") == 1
    # Only the daemon knows its limits: the web's registry leaves them out.
    assert "slurm_medic_drain_limit_per_hour" not in text
    for name, labels in samples:
        assert name.startswith("slurm_medic_"), name
        assert {key for key, _ in labels} <= ALLOWED_LABELS, (name, labels)
        assert not {label for _, label in labels} & facts.names, (name, labels)


def test_records_in_flight_are_two_series(fresh_engine: Engine) -> None:
    """Nothing held, nothing awaited: no held series, 0 awaited; then one of each."""
    readers = make_session_factory(fresh_engine, read_only=True)
    _text, samples = scrape(record_registry(readers))
    assert value(samples, "slurm_medic_records_awaited") == 0
    assert not any(name.startswith("slurm_medic_cursor_held") for name, _ in samples)
    since = datetime(2026, 12, 2, 1, 30, tzinfo=UTC)
    with make_session_factory(fresh_engine)() as session:
        lineage = repo.create_lineage(session, name="run", owner="alice", template="t")
        control.hold_cursor(
            session, name="finished_jobs", reason="accounting unreachable", now=since, start=since
        )
        awaited.note_awaited(
            session, slurm_job_id=77, lineage_id=lineage.id, now=since, accounting="no record yet"
        )
        session.commit()
    _text, samples = scrape(record_registry(readers))
    assert value(samples, "slurm_medic_records_awaited") == 1
    held = value(
        samples, "slurm_medic_cursor_held_since_timestamp_seconds", watcher="finished_jobs"
    )
    assert held == since.timestamp()


def test_an_unreadable_record_is_record_up_0_and_still_answers(tmp_path: Path) -> None:
    """A database without the schema (or gone): the scrape answers, saying so."""
    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "empty.db")))
    _text, samples = scrape(record_registry(make_session_factory(engine, read_only=True)))
    engine.dispose()
    assert value(samples, "slurm_medic_record_up") == 0
    assert value(samples, "slurm_medic_build_info", version="0.1.0") == 1
    assert {name for name, _ in samples} == {"slurm_medic_record_up", "slurm_medic_build_info"}


def test_a_session_that_cannot_even_open_is_record_up_0() -> None:
    def refuse() -> Session:
        raise RuntimeError  # no message at all: the warning still has something to say

    _text, samples = scrape(record_registry(refuse))
    assert value(samples, "slurm_medic_record_up") == 0


def test_the_web_app_serves_the_exposition_and_refuses_a_post(
    seeded: tuple[sessionmaker[Session], Seeded],
) -> None:
    readers, _facts = seeded
    client = TestClient(web_metrics_app(readers))
    answer = client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {family.name for family in text_string_to_metric_families(answer.text)}
    assert {"slurm_medic_record_up", "slurm_medic_incidents", "slurm_medic_leader"} - families == {
        "slurm_medic_leader"  # the daemon's own series are the daemon's to serve
    }
    assert client.post("/metrics").status_code == 405


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        body: bytes = answer.read()
    return body.decode()


def test_the_daemons_listener_answers_on_a_loopback_port_until_stopped(
    seeded: tuple[sessionmaker[Session], Seeded],
) -> None:
    readers, _facts = seeded
    registry = daemon_registry(readers, DaemonLimits(max_drains_per_hour=2, poll_interval_s=15))
    with serve_metrics("127.0.0.1:0", registry) as (host, port):
        assert host == "127.0.0.1"
        text = _get(f"http://127.0.0.1:{port}/metrics")
        _parsed, samples = scrape(registry)
    families = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "slurm_medic_record_up",
        "slurm_medic_incidents",
        "slurm_medic_leader",
        "slurm_medic_slurm_command_errors",
        "slurm_medic_probe_duration_seconds",
    } <= families
    assert value(samples, "slurm_medic_drain_limit_per_hour") == 2
    assert value(samples, "slurm_medic_poll_interval_seconds") == 15
    assert all(name.startswith("slurm_medic_") for name in families)
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port}/metrics")


def test_an_address_in_use_is_a_listen_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (
            pytest.raises(MetricsListenError, match=f"127.0.0.1:{port}"),
            serve_metrics(f"127.0.0.1:{port}", CollectorRegistry()),
        ):
            pass


def test_run_exits_2_when_its_metrics_address_is_taken(tmp_path: Path) -> None:
    database = tmp_path / "medic.db"
    engine = make_engine(StoreSettings(url=sqlite_url(database)))
    upgrade(engine)
    engine.dispose()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "config.toml"
        config.write_text(
            f'hook_socket = "{tmp_path}/hook.sock"\n[store]\nurl = "{sqlite_url(database)}"\n'
            f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
        )
        result = subprocess.run(
            [str(Path(sys.executable).parent / "slurm-medic"), "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert f"slurm-medic run: cannot serve metrics on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------- in-process series


def sample(name: str, **labels: str) -> float:
    found = series.IN_PROCESS.get_sample_value(name, labels)
    assert found is not None, (name, labels)
    return found


class ScriptedRunner:
    """Answers each program by name: an exit code, or a timeout."""

    def __init__(self, answers: dict[str, int | None]) -> None:
        self.answers = answers

    def __call__(
        self,
        argv: object,
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: object = None,
        cwd: str | None = None,
    ) -> CommandResult:
        assert isinstance(argv, list)
        code = self.answers[Path(argv[0]).name]
        if code is None:
            raise CommandTimeout("timed out", argv=argv)
        return CommandResult(tuple(argv), code, "", "failed" if code else "", 0.01)


def test_slurm_command_errors_are_counted_by_command_and_others_are_other() -> None:
    names = ("sacct", "sbatch", "squeue", "scontrol", "ssh")
    before = {
        name: sample("slurm_medic_slurm_command_errors_total", command=name)
        for name in ("sacct", "sbatch", "squeue", "scontrol", "other")
    }
    counting = series.SlurmErrorCounter(
        ScriptedRunner({"sacct": 1, "sbatch": None, "squeue": 0, "scontrol": 1, "ssh": 255})
    )
    for name in names:
        program = "/usr/bin/scontrol" if name == "scontrol" else name
        try:
            counting([program, "--json"], timeout=1)
        except CommandTimeout:
            assert name == "sbatch"
    after = {
        name: sample("slurm_medic_slurm_command_errors_total", command=name) for name in before
    }
    assert {name: after[name] - before[name] for name in before} == {
        "sacct": 1,
        "sbatch": 1,
        "squeue": 0,
        "scontrol": 1,
        "other": 1,
    }


@pytest.fixture
def probe_settings(tmp_path: Path) -> ProbeSettings:
    (tmp_path / "key").write_text("k")
    (tmp_path / "known_hosts").write_text("")
    return ProbeSettings(key_path=tmp_path / "key", known_hosts_path=tmp_path / "known_hosts")


def test_probe_fetches_are_timed_and_failures_counted_by_reason(
    probe_settings: ProbeSettings,
) -> None:
    def fetch(node: str) -> RawProbe:
        if node == "broken":
            raise RuntimeError("a bug in the fetch")
        if node == "no-key":
            return RawProbe(node, NOW, None, "refused", series.ProbeFailure.HOST_KEY)
        return RawProbe(node, NOW, document())

    fetches = sample("slurm_medic_probe_duration_seconds_count")
    internal = sample("slurm_medic_probe_failures_total", reason="internal")
    host_key = sample("slurm_medic_probe_failures_total", reason="host_key")
    ssh = sample("slurm_medic_probe_failures_total", reason="ssh")
    prober = NodeProber(probe_settings, fetch=fetch, clock=lambda: NOW)
    prober.probe_many([])
    for node in ("gpu-01", "broken", "no-key"):
        prober.probe(node)
    assert sample("slurm_medic_probe_duration_seconds_count") - fetches == 3
    assert sample("slurm_medic_probe_failures_total", reason="internal") - internal == 1
    assert sample("slurm_medic_probe_failures_total", reason="host_key") - host_key == 1
    assert sample("slurm_medic_probe_failures_total", reason="ssh") == ssh


@dataclass
class DownSlurm(WindowSlurm):
    """Accounting that does not answer: the poll step fails."""

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> JobWindow:
        raise SlurmUnavailable("Slurm did not answer", argv=["sacct"], attempts=3, last_error="x")


def test_cycles_step_failures_and_leadership_are_series(fresh_engine: Engine) -> None:
    cycles = sample("slurm_medic_cycles_total")
    polls = sample("slurm_medic_step_failures_total", step="poll")
    leader = daemon(fresh_engine, DownSlurm())
    standby = daemon(fresh_engine, DownSlurm())
    leader.cycle()
    assert sample("slurm_medic_leader") == 1
    standby.cycle()
    assert sample("slurm_medic_leader") == 0
    leader.leader.release()
    assert sample("slurm_medic_cycles_total") - cycles == 2
    assert sample("slurm_medic_step_failures_total", step="poll") - polls == 1
    assert sample("slurm_medic_cycle_duration_seconds_count") >= 2


# ------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("listen", ["127.0.0.1:9464", "[::1]:9464", "metrics.example.org:80"])
def test_a_listen_address_is_host_and_port(listen: str) -> None:
    assert MetricsSettings(listen=listen).listen == listen


@pytest.mark.parametrize(
    "listen", ["9464", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1:9464\n", "http://h:1", "a b:1"]
)
def test_a_listen_address_that_is_not_one_is_refused(listen: str) -> None:
    with pytest.raises(ValidationError):
        MetricsSettings(listen=listen)


def test_metrics_are_off_unless_listen_is_set() -> None:
    assert Settings().metrics.listen is None
