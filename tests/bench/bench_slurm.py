"""Benchmark of the Slurm layer's parsers (pure) and, where a cluster answers, one sacct poll.

Prints figures only; `make bench` runs it. The parse figures bound how long one watch cycle
spends reading a large accounting window.
"""

from __future__ import annotations

import copy
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import SlurmError
from daemon.slurm.sacct import PARSABLE_DELIMITER
from daemon.slurm.sacct_json import parse_sacct_json
from daemon.slurm.sacct_parsable import parse_sacct_parsable

REAL = Path(__file__).resolve().parent.parent / "data" / "slurm" / "dbv0.0.38"


def _json_window(count: int) -> str:
    """`count` copies of the real 4-node FAILED job (two steps each), as one sacct answer."""
    document = json.loads((REAL / "failed.json").read_text())
    template = document["jobs"][0]
    jobs = []
    for index in range(count):
        job = copy.deepcopy(template)
        job["job_id"] = 1000 + index
        jobs.append(job)
    document["jobs"] = jobs
    return json.dumps(document)


def _parsable_window(count: int) -> str:
    lines = (REAL / "failed.parsable2").read_text().splitlines()
    out = []
    for index in range(count):
        for line in lines:
            fields = line.split(PARSABLE_DELIMITER)
            raw = fields[1]
            fields[0] = fields[1] = str(1000 + index) + raw[len(raw.split(".")[0]) :]
            out.append(PARSABLE_DELIMITER.join(fields))
    return "\n".join(out) + "\n"


def _best_of(runs: int, action: object) -> float:
    assert callable(action)
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    for count in (100, 1_000, 10_000):
        text = _json_window(count)
        seconds = _best_of(3, lambda text=text: parse_sacct_json(text))
        print(
            f"parse sacct --json (22.05)   {count:>6} jobs  {len(text) / 1e6:7.1f} MB  "
            f"{seconds * 1e3:8.1f} ms  {seconds / count * 1e6:6.1f} us/job"
        )
    for count in (100, 1_000, 10_000):
        text = _parsable_window(count)
        seconds = _best_of(3, lambda text=text: parse_sacct_parsable(text, local_tz=UTC))
        print(
            f"parse sacct --parsable2      {count:>6} jobs  {len(text) / 1e6:7.1f} MB  "
            f"{seconds * 1e3:8.1f} ms  {seconds / count * 1e6:6.1f} us/job"
        )
    cli = SlurmCli(timeout_s=10, attempts=1)
    now = datetime.now(UTC)
    try:
        started = time.perf_counter()
        jobs = cli.finished_jobs(now - timedelta(days=1), now)
        seconds = time.perf_counter() - started
    except SlurmError as error:
        print(f"live finished_jobs poll: skipped, no cluster answered ({error})")
        return
    print(
        f"live finished_jobs poll (1 sacct --json call, last 24 h): {len(jobs)} jobs, "
        f"{seconds * 1e3:.0f} ms"
    )
