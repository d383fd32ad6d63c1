"""What one Prometheus scrape of the record costs after a year of a large cluster.

Fills a SQLite record as `bench_store` does (BENCH_METRICS_JOBS jobs, default 1,000,000: one
incident per ten jobs, their proposals, relaunches and node events), then times the record
collector's whole scrape (`generate_latest` over a fresh read-only session each time, median
of several runs) with the clock at the end of that year, so the relaunch-delay histogram reads
its last seven days. A scrape every 15 to 60 s should cost well under a second.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from daemon.metrics.record import RecordCollector
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.bench.bench_store import YEAR, YEAR_START, Scale, fill

RUNS = 7


def main() -> None:
    scale = Scale(jobs=int(os.environ.get("BENCH_METRICS_JOBS", "1000000")))
    with tempfile.TemporaryDirectory() as directory:
        engine = make_engine(StoreSettings(url=sqlite_url(Path(directory) / "medic.db")))
        upgrade(engine)
        counts = fill(engine, scale)
        print(f"filled {counts.rows} in {counts.seconds:.1f} s")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(
            RecordCollector(
                make_session_factory(engine, read_only=True), clock=lambda: YEAR_START + YEAR
            )
        )
        text = generate_latest(registry)  # warm: the first read pulls the pages in
        samples = []
        for _ in range(RUNS):
            started = time.perf_counter()
            text = generate_latest(registry)
            samples.append((time.perf_counter() - started) * 1000)
        engine.dispose()
    series = sum(1 for line in text.decode().splitlines() if not line.startswith("#"))
    print(
        f"scrape of the record: median {statistics.median(samples):.1f} ms,"
        f" max {max(samples):.1f} ms over {RUNS} runs; {series} series, {len(text)} bytes"
    )


if __name__ == "__main__":
    main()
