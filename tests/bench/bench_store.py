"""How fast the record answers its questions after a year of a large cluster.

Fills SQLite and a real PostgreSQL with BENCH_STORE_JOBS jobs (default 1,000,000) and one
incident per ten jobs, with proposals, actions, template revisions, node events and audit
events in proportion, then times each question (median of several runs, a different subject
each run, a fresh session each time). The fill bypasses the ORM on purpose: executemany on
SQLite, COPY on PostgreSQL, into the schema the migrations build (indexes and triggers on).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.evidence.records import Evidence, LogFindings, OomFamily, OomReport, Phase
from daemon.planner import Outcome, PlannedFix
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import control, queries
from daemon.store.codec import to_json
from daemon.store.engine import make_engine
from daemon.store.repository import FIX_COLUMNS
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from daemon.store.states import ProposalState
from daemon.templates.revisions import KnobChange, Patch
from remediators.base import Lever
from tests.postgres import running_postgres

YEAR_START = datetime(2025, 1, 1, tzinfo=UTC)
YEAR = timedelta(days=365)
USERS = 500
NODES = 2000
JOBS_PER_LINEAGE = 20
JOBS_PER_INCIDENT = 10
NODE_EVENTS_PER_INCIDENT = 0.05
RUNS = 7
TARGET_MS = 100.0
KINDS = [
    FailureKind.TRUE_OOM,
    FailureKind.TRUE_OOM,
    FailureKind.FRAGMENTATION,
    FailureKind.HOST_RAM,
    FailureKind.HARDWARE,
    FailureKind.COTENANT,
    FailureKind.WORKSPACE_SPIKE,
    FailureKind.OPTIMIZER_BURST,
    FailureKind.EVAL_GROWTH,
    FailureKind.NOT_OOM,
]
# Proposal outcomes over the year; the last days' proposals are still waiting for a person.
SETTLED_STATES = [
    ProposalState.VERIFIED,
    ProposalState.VERIFIED,
    ProposalState.VERIFIED,
    ProposalState.FAILED,
    ProposalState.REJECTED,
    ProposalState.SUPERSEDED,
    ProposalState.EXPIRED,
]
PENDING_WINDOW = timedelta(days=2)


@dataclass(frozen=True)
class Scale:
    jobs: int

    @property
    def incidents(self) -> int:
        return self.jobs // JOBS_PER_INCIDENT

    @property
    def lineages(self) -> int:
        return max(1, self.jobs // JOBS_PER_LINEAGE)

    @property
    def node_events(self) -> int:
        return max(4, int(self.incidents * NODE_EVENTS_PER_INCIDENT))


@dataclass(frozen=True)
class Counts:
    rows: dict[str, int]
    seconds: float


def _at(fraction: float) -> datetime:
    return YEAR_START + YEAR * fraction


def _sample_json(scale: Scale) -> tuple[str, dict[FailureKind, tuple[str, str]]]:
    """One real encoded job record and one evidence/diagnosis pair per kind, reused per row."""
    job = SlurmJob(
        job_id=1,
        name="llama-70b-pretrain",
        user="user0001",
        uid=20001,
        group="research",
        account="research",
        partition="gpu",
        state=JobState.FAILED,
        state_raw="FAILED",
        exit_code=1,
        exit_signal=None,
        derived_exit_code=None,
        derived_exit_signal=None,
        nodes=tuple(f"gpu-{n:04d}" for n in range(8)),
        batch_host="gpu-0000",
        submit_time=YEAR_START,
        start_time=YEAR_START,
        end_time=YEAR_START,
        stdout_path="/home/user0001/run/%j.out",
        stderr_path=None,
        work_dir="/home/user0001/run",
        comment=None,
    )
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        requested_bytes=2 * 2**30,
        total_bytes=80 * 2**30,
        free_bytes=2**29,
        reserved_bytes=79 * 2**30,
    )
    per_kind = {}
    for kind in set(KINDS):
        log = LogFindings(rank=3, node="gpu-0002", step=1200, phase=Phase.BACKWARD, oom=oom)
        diagnosis = Diagnosis(
            kind=kind,
            confidence=Confidence.HIGH,
            reasons=("reserved 79 GiB of 80 GiB", "failed at step 1200"),
            onset=Onset.MID_RUN,
            rank=3,
            node="gpu-0002",
            step=1200,
            phase=Phase.BACKWARD,
            oom=oom,
        )
        per_kind[kind] = (
            json.dumps(to_json(Evidence(log=log, job=job))),
            json.dumps(to_json(diagnosis)),
        )
    return json.dumps(to_json(job)), per_kind


class Writer:
    """Bulk rows into one table: executemany on SQLite, COPY on PostgreSQL."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sqlite = engine.dialect.name == "sqlite"

    def write(self, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]) -> int:
        raw = self.engine.raw_connection()
        try:
            if self.sqlite:
                count = self._sqlite(raw, table, columns, rows)
            else:
                count = self._copy(raw, table, columns, rows)
            raw.commit()
        finally:
            raw.close()
        return count

    def _sqlite(
        self, raw: Any, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]
    ) -> int:
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
        cursor = raw.cursor()
        cursor.execute("BEGIN")
        count = 0
        for chunk in _chunks(rows, 50_000):
            cursor.executemany(sql, [tuple(_sqlite_value(v) for v in row) for row in chunk])
            count += len(chunk)
        cursor.execute("COMMIT")
        return count

    def _copy(
        self, raw: Any, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]
    ) -> int:
        count = 0
        with raw.driver_connection.cursor() as cursor:
            with cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
                    count += 1
            if "id" in columns:
                cursor.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                    f"(SELECT max(id) FROM {table}))"
                )
        return count


def _plan_json() -> str:
    """What `repository.propose` keeps in `plan` for a micro-batch halving (the columns aside)."""
    fix = PlannedFix(
        remediator="micro_batch_down",
        lever=Lever.BATCH,
        kind=FailureKind.TRUE_OOM,
        rung=0,
        ladder=("micro_batch_down", "recompute_selective"),
        patch=Patch(
            (
                KnobChange("micro_batch", 4, 2),
                KnobChange("grad_accum", 8, 16),
            ),
            "micro_batch_down: halve the micro-batch and double accumulation",
        ),
        expected_effect="activation memory per micro-batch roughly halves",
        cost="~5-15% throughput",
        knobs_before={"micro_batch": 4, "grad_accum": 8},
        knobs_after={"micro_batch": 2, "grad_accum": 16},
        failing_step=1000,
        actions=(),
        skipped=(),
    )
    plan = to_json(fix)
    assert isinstance(plan, dict)
    return json.dumps({k: v for k, v in plan.items() if k not in FIX_COLUMNS})


PLAN_JSON = _plan_json()


def _sqlite_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return value


def _chunks(rows: Iterable[tuple[Any, ...]], size: int) -> Iterator[list[tuple[Any, ...]]]:
    chunk: list[tuple[Any, ...]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def fill(engine: Engine, scale: Scale) -> Counts:
    started = time.perf_counter()
    writer = Writer(engine)
    record_json, kind_json = _sample_json(scale)
    n_jobs, n_incidents, n_lineages = scale.jobs, scale.incidents, scale.lineages
    rows: dict[str, int] = {}

    def job_end(i: int) -> datetime:
        return _at(i / n_jobs)

    rows["lineage"] = writer.write(
        "lineage",
        ["id", "name", "owner", "template", "status", "attempts", "created_at", "updated_at"],
        (
            (
                k + 1,
                f"run-{k}",
                f"user{k % USERS:04d}",
                "hf-trainer",
                "verified" if k % 3 else "active",
                JOBS_PER_LINEAGE,
                job_end(k * JOBS_PER_LINEAGE),
                job_end(k * JOBS_PER_LINEAGE),
            )
            for k in range(n_lineages)
        ),
    )
    rows["job"] = writer.write(
        "job",
        [
            *("id", "slurm_job_id", "lineage_id", "attempt", "name", "user_name", "uid"),
            *("account", "partition", "state", "exit_code", "nodes", "submit_time"),
            *("start_time", "end_time", "record", "seen_at"),
        ],
        (
            (
                i + 1,
                1_000_000 + i,
                min(i // JOBS_PER_LINEAGE, n_lineages - 1) + 1,
                i % JOBS_PER_LINEAGE + 1,
                f"run-{i // JOBS_PER_LINEAGE}",
                f"user{(i // JOBS_PER_LINEAGE) % USERS:04d}",
                20_000 + (i // JOBS_PER_LINEAGE) % USERS,
                "research",
                "gpu",
                "FAILED" if i % JOBS_PER_INCIDENT == 0 else "COMPLETED",
                1 if i % JOBS_PER_INCIDENT == 0 else 0,
                json.dumps([f"gpu-{(i * 8 + n) % NODES:04d}" for n in range(8)]),
                job_end(i) - timedelta(hours=6),
                job_end(i) - timedelta(hours=5),
                job_end(i),
                record_json,
                job_end(i),
            )
            for i in range(n_jobs)
        ),
    )

    def incident_job(k: int) -> int:
        return k * JOBS_PER_INCIDENT

    def kind(k: int) -> FailureKind:
        return KINDS[(k * 7) % len(KINDS)]

    rows["incident"] = writer.write(
        "incident",
        [
            *("id", "job_id", "lineage_id", "slurm_job_id", "user_name", "kind", "confidence"),
            *("onset", "node", "rank", "step", "occurred_at", "recorded_at", "evidence"),
            "diagnosis",
        ],
        (
            (
                k + 1,
                incident_job(k) + 1,
                min(incident_job(k) // JOBS_PER_LINEAGE, n_lineages - 1) + 1,
                1_000_000 + incident_job(k),
                f"user{(incident_job(k) // JOBS_PER_LINEAGE) % USERS:04d}",
                kind(k).value,
                "high",
                "mid_run",
                f"gpu-{(k * 13) % NODES:04d}",
                k % 64,
                1000 + k % 5000,
                job_end(incident_job(k)),
                job_end(incident_job(k)),
                *kind_json[kind(k)],
            )
            for k in range(n_incidents)
        ),
    )
    year_end = YEAR_START + YEAR

    def state(k: int) -> ProposalState:
        if year_end - job_end(incident_job(k)) < PENDING_WINDOW:
            return ProposalState.PROPOSED
        return SETTLED_STATES[k % len(SETTLED_STATES)]

    submitted = {ProposalState.VERIFIED, ProposalState.FAILED, ProposalState.SUPERSEDED}
    rows["proposal"] = writer.write(
        "proposal",
        [
            *("id", "incident_id", "lineage_id", "remediator", "lever", "rung", "failing_step"),
            *("plan", "outcome", "rationale", "cost"),
            *("changes_science", "state", "created_at", "updated_at", "decided_by"),
            "relaunch_job_id",
        ],
        (
            (
                k + 1,
                k + 1,
                min(incident_job(k) // JOBS_PER_LINEAGE, n_lineages - 1) + 1,
                "micro_batch_down",
                Lever.BATCH.value,
                0,
                1000 + k % 5000,
                PLAN_JSON,
                Outcome.PENDING.value,
                "halve the micro-batch and double accumulation: the global batch is kept",
                1.0,
                False,
                state(k).value,
                job_end(incident_job(k)),
                job_end(incident_job(k)),
                None if state(k) is ProposalState.PROPOSED else "slurm-medic",
                1_000_000 + incident_job(k) + 1 if state(k) in submitted else None,
            )
            for k in range(n_incidents)
        ),
    )
    sbatch = [k for k in range(n_incidents) if state(k) in submitted]
    rows["action"] = writer.write(
        "action",
        [
            *("id", "proposal_id", "kind", "argv", "token", "slurm_job_id", "started_at"),
            *("finished_at", "exit_code", "stdout", "stderr", "result"),
        ],
        (
            (
                n + 1,
                k + 1,
                "sbatch",
                json.dumps(["sbatch", "--parsable", f"--comment=medic-{k:032x}", "rev.sbatch"]),
                f"medic-{k:032x}",
                1_000_000 + incident_job(k) + 1,
                job_end(incident_job(k)),
                job_end(incident_job(k)),
                0,
                f"{1_000_000 + incident_job(k) + 1}\n",
                "",
                "succeeded",
            )
            for n, k in enumerate(sbatch)
        ),
    )
    rows["template_revision"] = writer.write(
        "template_revision",
        [
            *("id", "lineage_id", "parent_id", "proposal_id", "knobs", "rendered_script"),
            *("script_sha256", "created_at"),
        ],
        (
            (
                n + 1,
                min(incident_job(k) // JOBS_PER_LINEAGE, n_lineages - 1) + 1,
                None,
                k + 1,
                '{"micro_batch": 4, "grad_accum": 8}',
                "#!/bin/bash\n#SBATCH --nodes=8\nsrun python train.py --micro-batch 4\n",
                f"{k:064x}",
                job_end(incident_job(k)),
            )
            for n, k in enumerate(sbatch)
        ),
    )
    rows["node_event"] = writer.write(
        "node_event",
        ["id", "node", "kind", "by_medic", "reason", "occurred_at", "incident_id", "action_id"],
        (
            (
                e + 1,
                f"gpu-{(e * 37) % NODES:04d}",
                "drain" if (e // NODES) % 2 == 0 else "resume",
                e % 5 != 0,
                "medic: XID 79 on GPU 3",
                _at(e / scale.node_events),
                None,
                None,
            )
            for e in range(scale.node_events)
        ),
    )
    audit_columns = [
        *("at", "actor_kind", "actor_name", "actor_uid", "verb", "subject_type"),
        *("subject_id", "details"),
    ]

    def audit_rows() -> Iterator[tuple[Any, ...]]:
        for k in range(n_incidents):
            at = job_end(incident_job(k))
            pid = str(k + 1)
            yield (at, "daemon", "slurm-medic", None, "propose", "proposal", pid, "{}")
            final = state(k)
            if final is ProposalState.PROPOSED:
                continue
            yield (at, "user", "alice", 1001, f"proposal_{final.value}", "proposal", pid, "{}")
        for n, k in enumerate(sbatch):
            at = job_end(incident_job(k))
            yield (at, "daemon", "slurm-medic", None, "submit_intent", "action", str(n + 1), "{}")
            yield (at, "daemon", "slurm-medic", None, "submitted", "action", str(n + 1), "{}")

    rows["audit_event"] = writer.write("audit_event", audit_columns, audit_rows())
    _settle(engine)
    return Counts(rows=rows, seconds=time.perf_counter() - started)


def _settle(engine: Engine) -> None:
    """What a year of routine upkeep leaves: planner statistics, and on PostgreSQL the
    visibility map autovacuum keeps (without it no index-only scan is possible after a COPY)."""
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM ANALYZE"))
        return
    with engine.begin() as connection:
        connection.execute(text("ANALYZE"))


def questions(scale: Scale) -> dict[str, Callable[[Session, int], object]]:
    """Each question, given a run number so every run asks about a different subject."""
    n_incidents = scale.incidents

    def some_incident(run: int) -> int:
        return n_incidents // 3 + run * 7919 % max(1, n_incidents // 2)

    def month(run: int) -> datetime:
        return _at((run % 11) / 12)

    return {
        "lineage history": lambda s, run: queries.lineage_story(
            s, lineage_id=scale.lineages // 2 + run
        ),
        "everything about a job id": lambda s, run: queries.job_story(
            s, slurm_job_id=1_000_000 + some_incident(run) * JOBS_PER_INCIDENT
        ),
        "drains in force": lambda s, run: control.drains_in_force(s),
        "pending approvals": lambda s, run: queries.pending_approvals(s),
        "incidents of a kind, 30 days": lambda s, run: queries.incidents_by_kind(
            s,
            kind=KINDS[run % len(KINDS)],
            since=month(run),
            until=month(run) + timedelta(days=30),
        ),
        "incidents of a user, 30 days": lambda s, run: queries.find_incidents(
            s,
            user=f"user{run * 37 % USERS:04d}",
            since=month(run),
            until=month(run) + timedelta(days=30),
        ),
        "incidents on a node, 30 days": lambda s, run: queries.find_incidents(
            s,
            node=f"gpu-{run * 13 % NODES:04d}",
            since=month(run),
            until=month(run) + timedelta(days=30),
        ),
        "incident counts by kind, 30 days": lambda s, run: queries.count_incidents_by_kind(
            s, since=month(run), until=month(run) + timedelta(days=30)
        ),
        "incident counts by kind, a year": lambda s, run: queries.count_incidents_by_kind(
            s, since=YEAR_START, until=YEAR_START + YEAR
        ),
        "audit trail of a proposal": lambda s, run: queries.proposal_audit_trail(
            s, proposal_id=some_incident(run) + 1
        ),
    }


def _size(result: object) -> int:
    if isinstance(result, queries.LineageStory):
        return len(result.attempts)
    if isinstance(result, queries.JobStory):
        return (
            len(result.incidents) + len(result.proposals) + len(result.actions) + len(result.audit)
        )
    if isinstance(result, list | dict):
        return len(result)
    return 0


def time_questions(engine: Engine, scale: Scale) -> dict[str, tuple[float, int]]:
    """Median milliseconds and result size of each question."""
    timings: dict[str, tuple[float, int]] = {}
    for name, ask in questions(scale).items():
        with Session(engine) as warm:
            ask(warm, RUNS)
        samples: list[float] = []
        size = 0
        for run in range(RUNS):
            with Session(engine) as session:
                started = time.perf_counter()
                result = ask(session, run)
                samples.append((time.perf_counter() - started) * 1000)
                size = _size(result)
        timings[name] = (statistics.median(samples), size)
    return timings


def main() -> None:
    scale = Scale(jobs=int(os.environ.get("BENCH_STORE_JOBS", "1000000")))
    print(
        f"bench_store: {scale.jobs:,} jobs, {scale.incidents:,} incidents, "
        f"{scale.lineages:,} lineages; median of {RUNS} runs, target {TARGET_MS:.0f} ms",
        flush=True,
    )
    results: dict[str, dict[str, tuple[float, int]]] = {}
    with ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-store-")))
        server = stack.enter_context(running_postgres())
        urls = {
            "sqlite": sqlite_url(directory / "medic.db"),
            "postgresql": server.create_database("medic_bench"),
        }
        for backend, url in urls.items():
            engine = make_engine(StoreSettings(url=url))
            try:
                upgrade(engine)
                counts = fill(engine, scale)
                total = sum(counts.rows.values())
                print(
                    f"{backend}: filled {total:,} rows in {counts.seconds:.1f} s "
                    f"({', '.join(f'{t} {n:,}' for t, n in counts.rows.items())})",
                    flush=True,
                )
                results[backend] = time_questions(engine, scale)
            finally:
                engine.dispose()
    _print_table(results)


def _print_table(results: dict[str, dict[str, tuple[float, int]]]) -> None:
    backends = list(results)
    names = list(next(iter(results.values())))
    width = max(len(name) for name in names)
    print(f"{'question':<{width}}  " + "  ".join(f"{b + ' ms':>14}  rows" for b in backends))
    for name in names:
        cells = []
        for backend in backends:
            ms, size = results[backend][name]
            flag = " " if ms <= TARGET_MS else "!"
            cells.append(f"{ms:>13.2f}{flag}  {size:>4}")
        print(f"{name:<{width}}  " + "  ".join(cells))
    print("(! marks a question over the target)")
