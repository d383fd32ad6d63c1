"""What the fleet sweep costs at a large cluster's scale, SSH aside.

A year of hourly sweeps of BENCH_FLEET_NODES nodes (default 1,000: 8.76 million checks) is
written into a SQLite record, a few percent of them with a pending remap for a week and then a
drain; then the record's fleet questions are timed (median of several runs, a fresh session
each): each node's last check (the daemon asks it every cycle to know who is due), every
node's latest check (`slurm-medic nodes`), a month's history of pending remaps with the jobs
that died on those nodes (`nodes history`), one node's story (`show NODE`) and the checks since
a drain (the return to service). Last, one sweep of every node judged and recorded, the probe
documents served from memory (the real probe program's output for a healthy node), so what
is timed is the judging, the policy and the record.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import Session

from daemon.config import Settings
from daemon.evidence.prober import NodeProber, ProbeSettings, RawProbe
from daemon.fleet.sweep import SweepDeps, SweepTarget, sweep
from daemon.slurm.records import JobWindow, NodeBaseState, SlurmJob, SlurmNode
from daemon.store import node_records
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import CheckTrigger
from daemon.store.repository import Actor
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.bench.bench_store import Writer

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 1, 1, tzinfo=UTC)
HOURS = 365 * 24
REMAP_SHARE = 0.03  # nodes that show a pending remap for a week during the year
RUNS = 7


def _nodes(count: int) -> list[str]:
    return [f"gpu-{index:04d}" for index in range(count)]


def _check_rows(nodes: list[str]) -> Iterator[tuple[object, ...]]:
    """One check per node per hour for a year; some nodes show a pending remap for a week."""
    sick = {
        node: (index * 7919) % HOURS for index, node in enumerate(nodes[:: int(1 / REMAP_SHARE)])
    }
    healthy = ("healthy", "8 GPUs of 8: no remap pending or failed", ",", "[]", "record")
    pending = (
        "faulty",
        "GPU 2 (00000000:47:00.0): row remap pending (1 correctable, 0 uncorrectable rows)",
        ",remap_pending,",
        '[{"kind": "remap_pending", "health": "faulty", "text": "row remap pending", "gpu": 2}]',
        "drain_after_job",
    )
    for hour in range(HOURS):
        at = NOW - timedelta(hours=HOURS - hour)
        for node in nodes:
            start = sick.get(node)
            state = pending if start is not None and start <= hour < start + 24 * 7 else healthy
            health, deciding, kinds, findings, decision = state
            yield (
                node, at, "schedule", health, deciding, kinds, findings, "[]", 8, 8, "[]",
                None, decision, decision, "slurm-medic",
            )  # fmt: skip


CHECK_COLUMNS = (
    "node", "checked_at", "trigger", "health", "deciding", "kinds", "findings", "notes",
    "gpus_seen", "gpus_expected", "running_jobs", "after_job_id", "decision", "decision_reason",
    "actor_name",
)  # fmt: skip


def _median_ms(run: Callable[[Session], object], sessions: Callable[[], Session]) -> float:
    times = []
    for _ in range(RUNS):
        with sessions() as session:
            started = time.perf_counter()
            run(session)
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


@dataclass
class _Slurm:
    nodes_list: tuple[SlurmNode, ...]

    def nodes(self) -> tuple[SlurmNode, ...]:
        return self.nodes_list

    def running_jobs(self, *, users: object = ()) -> tuple[SlurmJob, ...]:
        return ()

    def finished_window(self, since: datetime, until: datetime, states: object = ()) -> JobWindow:
        return JobWindow(())


def _healthy_document() -> str:
    """The real probe program's document for a healthy fixture node."""
    env = {
        **os.environ,
        "MEDIC_FIXTURE_DIR": str(REPO / "deploy/devcluster/node-states/healthy"),
        "PATH": f"{REPO / 'deploy/devcluster/fixture-bin'}:{os.environ['PATH']}",
    }
    probe = REPO / "daemon/installable/node_probe.py"
    return subprocess.run(
        [str(probe)], capture_output=True, text=True, check=True, env=env, timeout=60
    ).stdout


def main() -> None:
    count = int(os.environ.get("BENCH_FLEET_NODES", "1000"))
    nodes = _nodes(count)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
        root = Path(scratch)
        engine = make_engine(StoreSettings(url=sqlite_url(root / "medic.db")))
        upgrade(engine)
        started = time.perf_counter()
        written = Writer(engine).write("node_check", CHECK_COLUMNS, _check_rows(nodes))
        fill_s = time.perf_counter() - started
        size_mib = (root / "medic.db").stat().st_size / 2**20
        print(f"{count} nodes, {written:,} checks ({size_mib:,.0f} MiB) written in {fill_s:.0f} s")
        sessions = make_session_factory(engine)
        month = NOW - timedelta(days=30)
        questions: list[tuple[str, Callable[[Session], object]]] = [
            ("each node's last check (every cycle)", lambda s: node_records.last_checked(s, nodes)),
            ("every node's latest check (nodes)", node_records.latest_checks),
            (
                "pending remaps in a year, with jobs (nodes history)",
                lambda s: node_records.finding_history(
                    s, kind="remap_pending", since=NOW - timedelta(days=365), until=NOW
                ),
            ),
            ("pending remaps in a month", lambda s: node_records.finding_history(
                s, kind="remap_pending", since=month, until=NOW)),
            ("one node's story (show NODE)", lambda s: node_records.node_story(s, nodes[0])),
            (
                "checks since a drain a week ago",
                lambda s: node_records.checks_after(
                    s, nodes[0], after_id=node_records.check_before(
                        s, nodes[0], at=NOW - timedelta(days=7))
                ),
            ),
        ]  # fmt: skip
        for label, question in questions:
            print(f"  {label}: {_median_ms(question, sessions):.1f} ms")
        for name in ("key", "known_hosts"):
            (root / name).write_text("x")
        probe = ProbeSettings(key_path=root / "key", known_hosts_path=root / "known_hosts")
        document = _healthy_document()
        prober = NodeProber(probe, fetch=lambda node: RawProbe(node, NOW, document))
        slurm = _Slurm(
            tuple(
                SlurmNode(n, None, NodeBaseState.IDLE, frozenset(), None, None, None, "gpu:8")
                for n in nodes
            )
        )
        deps = SweepDeps(Settings(probe=probe), slurm, prober, lambda: NOW, Actor.daemon())  # type: ignore[arg-type]
        targets = [
            SweepTarget(node, CheckTrigger.SCHEDULE, NOW - timedelta(hours=1)) for node in nodes
        ]
        with sessions() as session:
            started = time.perf_counter()
            swept = sweep(session, deps, targets, act=True)
            took = time.perf_counter() - started
        print(
            f"  one sweep of {len(swept)} nodes judged and recorded (SSH aside): {took:.2f} s,"
            f" {took / len(swept) * 1000:.2f} ms a node"
        )
        engine.dispose()
