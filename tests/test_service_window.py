"""The poll through the real Slurm layer (SlurmCli and its parsers; only the subprocess seam is
faked, answering with real 22.05 output): a record of the window that cannot be read goes on
the record once, with its text, and never holds the window back; the full records of the jobs
to handle are asked for in one batch, so a cycle's subprocesses do not grow three per job."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from daemon.config import Settings
from daemon.process import CommandResult
from daemon.service import Daemon
from daemon.slurm.backend import SlurmCli
from daemon.slurm.records import RAW_CHARS
from daemon.store import control
from daemon.store.engine import make_session_factory
from daemon.store.models import AuditEvent
from daemon.store.schema import upgrade
from daemon.store.service_records import SUBJECT_UNREADABLE, VERB_HANDLED, VERB_REJECTED
from daemon.watch import CURSOR
from tests.test_pipeline import FRAGMENTED, FakeFiles, start_lineage
from tests.test_service_poll import settings_for

REAL = Path(__file__).parent / "data" / "slurm" / "dbv0.0.38"
# The real jobs end at 2026-11-22T03:12:42..03:14:10Z; the poll runs a little later.
NOW = datetime(2026, 11, 22, 3, 20, tzinfo=UTC)
UNREADABLE_END = 10**19  # past any time a record can hold: the parser rejects the job alone


def _document(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((REAL / name).read_text())
    return loaded


def _real_jobs() -> dict[int, dict[str, Any]]:
    """Jobs 5 (FAILED), 7 (TIMEOUT), 14 (NODE_FAIL) and 16 (an array task, FAILED)."""
    jobs: dict[int, dict[str, Any]] = {}
    for name in ("failed.json", "timeout.json", "node-fail.json", "array.json"):
        for job in _document(name)["jobs"]:
            # The capture's own comment ("tok-failed") is no token of the lineages these tests
            # start (theirs are random), and a job joins a lineage only carrying its token.
            job["comment"] = {**job["comment"], "job": None}
            jobs[job["job_id"]] = job
    return jobs


def _parsable_rows() -> dict[int, str]:
    rows: dict[int, list[str]] = {}
    for name in ("failed.parsable2", "timeout.parsable2", "node-fail.parsable2"):
        for line in (REAL / name).read_text().splitlines():
            job_key = line.split("\x1f")[1].partition(".")[0]
            rows.setdefault(int(job_key), []).append(line)
    return {job_id: "\n".join(lines) + "\n" for job_id, lines in rows.items()}


def _broken(job: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    broken: dict[str, Any] = json.loads(json.dumps(job))
    broken["time"]["end"] = UNREADABLE_END
    broken.update(changes)
    return broken


@dataclass
class SlurmSeam:
    """The subprocess seam as 22.05 answers: `window` for the poll's sacct call, the real
    records for `sacct --jobs`, `--parsable2` and `scontrol show job`; records every argv."""

    window: list[dict[str, Any]]
    jobs: dict[int, dict[str, Any]] = field(default_factory=_real_jobs)
    rows: dict[int, str] = field(default_factory=_parsable_rows)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        call = tuple(argv)
        self.calls.append(call)
        if call == ("sdiag",):  # slurmctld holds nothing back for slurmdbd
            return _answer(call, (REAL / "sdiag-idle.txt").read_text())
        if call[:2] == ("scontrol", "--oneliner") and call[-1] == "5":
            return _answer(call, (REAL / "scontrol-show-job-failed.txt").read_text())
        if call[0] == "scontrol":  # slurmctld forgot the others (MinJobAge)
            return _answer(call, "", 1, "slurm_load_jobs error: Invalid job id specified")
        if "--starttime" in call:
            return _answer(call, self._sacct_json(self.window))
        asked = [int(text) for text in call[call.index("--jobs") + 1].split(",")]
        if "--json" in call:
            return _answer(call, self._sacct_json([self.jobs[i] for i in asked if i in self.jobs]))
        return _answer(call, "".join(self.rows.get(job_id, "") for job_id in asked))

    @staticmethod
    def _sacct_json(jobs: list[dict[str, Any]]) -> str:
        document = _document("failed.json")
        document["jobs"] = jobs
        return json.dumps(document)

    def counts(self) -> Counter[str]:
        """Calls by kind: the command and, for sacct, its output format."""
        return Counter(
            f"{call[0]} {call[1]}" if call[0] == "sacct" else " ".join(call[:4])
            for call in self.calls
        )


def _answer(argv: tuple[str, ...], out: str, code: int = 0, err: str = "") -> CommandResult:
    return CommandResult(argv=argv, returncode=code, stdout=out, stderr=err, duration_s=0.01)


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    upgrade(empty_db_engine)
    return empty_db_engine


def _daemon(engine: Engine, seam: SlurmSeam, now: datetime = NOW) -> Daemon:
    # Proposals wait for a person: the cycle handles jobs and submits nothing.
    settings = Settings.model_validate(
        {**settings_for(engine).model_dump(), "policy": {"auto_approve": []}}
    )
    backend = SlurmCli(runner=seam, attempts=1, euid=0, local_tz=UTC, clock=lambda: now)
    files = FakeFiles(dict.fromkeys(_real_jobs(), FRAGMENTED))
    return Daemon(settings, backend=backend, files=files, engine=engine, clock=lambda: now)


def _cycle(engine: Engine, seam: SlurmSeam, now: datetime = NOW) -> tuple[list[str], int]:
    daemon = _daemon(engine, seam, now)
    report = daemon.cycle()
    daemon.leader.release()
    return report.errors, report.rejected


def _lineages(engine: Engine, *job_ids: int) -> None:
    with make_session_factory(engine)() as session:
        for job_id in job_ids:
            start_lineage(session, job_id)
        session.commit()


def _events(engine: Engine, verb: str) -> list[AuditEvent]:
    with make_session_factory(engine)() as session:
        query = select(AuditEvent).where(AuditEvent.verb == verb).order_by(AuditEvent.id)
        return list(session.scalars(query))


def _cursor(engine: Engine) -> datetime | None:
    with make_session_factory(engine)() as session:
        return control.get_cursor(session, name=CURSOR)


def test_a_broken_record_among_good_ones_is_recorded_once_and_the_others_are_handled(
    fresh_engine: Engine,
) -> None:
    _lineages(fresh_engine, 5, 14, 16)
    jobs = _real_jobs()
    broken = _broken(jobs[16])
    seam = SlurmSeam(window=[jobs[5], broken, jobs[14]])
    assert _cycle(fresh_engine, seam) == ([], 1)
    assert _cycle(fresh_engine, seam, NOW + timedelta(minutes=1)) == ([], 0)  # window re-read
    assert sorted(event.subject_id for event in _events(fresh_engine, VERB_HANDLED)) == [
        "14",
        "5",
    ]
    (event,) = _events(fresh_engine, VERB_REJECTED)
    assert (event.subject_type, event.subject_id) == ("job", "16")
    assert event.details["source"] == "sacct --json (dbv0.0.38)"
    assert "time.end" in event.details["reason"]
    assert json.loads(event.details["raw"]) == broken  # its own text, whole: it fits
    assert event.details["raw_chars"] == len(json.dumps(broken))
    assert _cursor(fresh_engine) == NOW + timedelta(minutes=1)


def test_a_window_of_nothing_but_broken_records_moves_the_cursor(fresh_engine: Engine) -> None:
    """Before: the parser's "no job could be read" failed the poll, and every cycle after it."""
    jobs = _real_jobs()
    no_id = _broken(jobs[5], job_id="5; not a number")
    seam = SlurmSeam(window=[_broken(jobs[16]), no_id])
    assert _cycle(fresh_engine, seam) == ([], 2)
    assert _cursor(fresh_engine) == NOW
    assert _cycle(fresh_engine, seam, NOW + timedelta(minutes=1)) == ([], 0)
    assert _cursor(fresh_engine) == NOW + timedelta(minutes=1)
    subjects = [
        (event.subject_type, event.subject_id) for event in _events(fresh_engine, VERB_REJECTED)
    ]
    assert subjects[0] == ("job", "16")
    assert subjects[1][0] == SUBJECT_UNREADABLE
    assert len(subjects) == 2


def test_a_huge_record_is_kept_as_its_first_printable_kilobytes(fresh_engine: Engine) -> None:
    jobs = _real_jobs()
    hostile = _broken(jobs[16], name="x\n\x1b[2J\u2028" * 5000)
    assert _cycle(fresh_engine, SlurmSeam(window=[hostile, jobs[5]])) == ([], 1)
    (event,) = _events(fresh_engine, VERB_REJECTED)
    raw = event.details["raw"]
    assert len(raw) == RAW_CHARS
    assert raw.isascii()
    assert raw.isprintable()
    assert raw.startswith('{"account": "training"')
    assert event.details["raw_chars"] == len(json.dumps(hostile))


def test_a_cycle_asks_for_every_jobs_full_record_in_one_batch(fresh_engine: Engine) -> None:
    """Three jobs to handle: before, 1 + 3 x 3 = 10 calls (sacct --json, sacct --parsable2 and
    scontrol per job); now the window, one sacct --json and one --parsable2 for all of them,
    and scontrol per job (it takes one id)."""
    _lineages(fresh_engine, 5, 7, 14)
    jobs = _real_jobs()
    seam = SlurmSeam(window=[jobs[5], jobs[7], jobs[14], _broken(jobs[16])])
    assert _cycle(fresh_engine, seam) == ([], 1)
    assert seam.counts() == {
        "sdiag": 1,
        "sacct --json": 2,
        "sacct --parsable2": 1,
        "scontrol --oneliner show job": 3,
    }
    batched = [call for call in seam.calls if "--jobs" in call]
    # in the order the jobs ended
    assert [call[call.index("--jobs") + 1] for call in batched] == ["5,14,7", "5,14,7"]
    assert len(_events(fresh_engine, VERB_HANDLED)) == 3
