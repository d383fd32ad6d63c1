"""How soon the daemon hears of a job's end through the epilog hook.

Runs the real hook script (a fresh interpreter each time, as slurmctld does) against a
listening `HookListener` and times from the hook's start to the listener's callback; also
times the hook alone with nobody listening (what a job's epilog pays when the daemon is down).
"""

from __future__ import annotations

import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

from daemon.hook import HookListener
from daemon.process import run

EPILOG = Path(__file__).parents[2] / "daemon" / "installable" / "epilog.py"
RUNS = 30


def _hook(path: Path, job_id: int) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_MEDIC_HOOK_SOCKET": str(path),
    }
    run([sys.executable, "-IS", str(EPILOG)], timeout=10, env=env, check=True)


def _figures(label: str, samples: list[float]) -> None:
    ordered = sorted(samples)
    print(
        f"{label}: median {statistics.median(ordered) * 1000:.1f} ms,"
        f" p90 {ordered[int(len(ordered) * 0.9)] * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
        f" over {len(ordered)} runs"
    )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-hook-", dir="/tmp") as directory:
        path = Path(directory) / "hook.sock"
        woken: queue.Queue[tuple[int, float]] = queue.Queue()
        listener = HookListener(path, on_job=lambda job: woken.put((job, time.monotonic())))
        listener.start()
        latencies = []
        try:
            for job_id in range(1, RUNS + 1):
                started = time.monotonic()
                _hook(path, job_id)
                seen, at = woken.get(timeout=5)
                assert seen == job_id
                latencies.append(at - started)
        finally:
            listener.stop()
        _figures("hook start -> daemon callback", latencies)
        alone = []
        for job_id in range(RUNS):
            started = time.monotonic()
            _hook(Path(directory) / "nobody.sock", job_id)
            alone.append(time.monotonic() - started)
        _figures("hook with no daemon listening (whole run)", alone)


if __name__ == "__main__":
    main()
