"""What a page of `slurm-medic web` costs on a big record: the real server on its unix socket.

Fills a SQLite record as `bench_store` does (BENCH_WEB_JOBS jobs, default 100,000 over the
bench's year: 10,000 incidents and their proposals, relaunches and node events), starts the
real `slurm-medic web --socket` on it, and times whole requests over the socket as root (who
sees every run: the widest page), median and max of RUNS each. Each request opens its own
session on the record, as every page does. The last rows time root's requests while another
peer, bob, holds HELD idle connections (more than his cap of 64: the rest refused); the
server's read timeout is raised for the bench so that his stay open throughout.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy import select

from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import Lineage
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.bench.bench_store import Scale, fill
from tests.web_support import held_as

MEDIC = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "slurm-medic"
RUNS = 30
START_S = 30
HELD = 100


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def _get(path: str, target: str) -> int:
    connection = _UnixConnection(path)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def _timed(path: str, page: str) -> list[float]:
    """RUNS whole requests for `page`, in ms; each must answer 200."""
    samples = []
    for _ in range(RUNS):
        started = time.perf_counter()
        if _get(path, page) != 200:
            raise SystemExit(f"{page} did not answer 200")
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _row(label: str, samples: list[float]) -> None:
    print(f"{label:<42} median {statistics.median(samples):7.1f} ms  max {max(samples):7.1f} ms")


def main() -> None:
    scale = Scale(jobs=int(os.environ.get("BENCH_WEB_JOBS", "100000")))
    with (
        tempfile.TemporaryDirectory() as directory,
        tempfile.TemporaryDirectory(prefix="medic-web-") as socket_dir,
    ):
        os.chmod(socket_dir, 0o755)  # bob must reach the socket; nothing else is in it
        database = Path(directory) / "medic.db"
        engine = make_engine(StoreSettings(url=sqlite_url(database)))
        upgrade(engine)
        counts = fill(engine, scale)
        with make_session_factory(engine)() as session:
            lineage = session.scalars(select(Lineage.id).order_by(Lineage.id.desc())).first()
        engine.dispose()
        print(f"filled {counts.rows} in {counts.seconds:.1f} s")
        config = Path(directory) / "web.toml"
        config.write_text(
            f'[store]\nurl = "{sqlite_url(database)}"\n\n[web]\nread_timeout_s = 300\n',
            encoding="utf-8",
        )
        sock = Path(socket_dir) / "web.sock"
        server = subprocess.Popen(
            [str(MEDIC), "web", "--socket", str(sock), "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + START_S
            while not sock.exists():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("slurm-medic web did not start")
                time.sleep(0.05)
            pages = (
                "/healthz",
                "/",
                "/approvals",
                "/runs?since=2025-01-01",
                f"/runs/{lineage}",
                "/nodes",
                "/api/status",
                "/api/history?since=2025-12-01&limit=200",
                "/metrics",
            )
            for page in pages:
                if _get(str(sock), page) != 200:  # warm, and the page must answer
                    raise SystemExit(f"{page} did not answer 200")
                _row(page, _timed(str(sock), page))
            with held_as("bob", sock, HELD):
                for page in ("/healthz", "/api/status"):
                    _row(f"{page} (bob holds {HELD} idle)", _timed(str(sock), page))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=15)
