"""Diagnose time on big logs against `grep -n` over the same file.

Builds logs of 1, 4 and 16 GB (or `BENCH_SIZES_GB`, e.g. `BENCH_SIZES_GB=0.5,1`) made of
realistic training lines, with a multi-rank OOM failure either at the very end or 1 GB before
the end, then prints: the in-process scan + diagnose time, the cold `slurm-medic diagnose
--json` subprocess time, and `grep -n -F 'CUDA out of memory'` over the same file. Sizes that
do not fit on the disk (with 1 GB to spare) are skipped, saying so; every file is deleted.
Files are written into `BENCH_DIR` (default: the system temporary directory) and are still
in the page cache when read, as a fresh log of a job that just died would be.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daemon.diagnosis import History, diagnose
from daemon.evidence.joblog import scan_log
from daemon.evidence.records import Evidence

GB = 1024**3
CHUNK_BYTES = 64 * 1024 * 1024
SPARE_BYTES = GB
DEFAULT_SIZES_GB = (1.0, 4.0, 16.0)
FAILURE = Path(__file__).parents[1] / "data" / "logs" / "torchrun_multirank_backward_oom.log"


def _filler_chunk() -> bytes:
    lines = []
    for step in range(20_000):
        lines.append(
            f"0: [rank0]: {{'loss': {2.0 - step / 1e5:.4f}, 'grad_norm': 0.93, "
            f"'learning_rate': 1.98e-05, 'epoch': {step / 20_000:.2f}}}\n"
        )
        lines.append(f"0:  {step // 200:2d}%|##        | {step}/20000 [05:31<41:17,  2.81s/it]\n")
    block = "".join(lines).encode()
    repeat = CHUNK_BYTES // len(block) + 1
    return (block * repeat)[:CHUNK_BYTES].rsplit(b"\n", 1)[0] + b"\n"


def _write_filler(fd: int, size: int, chunk: bytes) -> None:
    while size > 0:
        piece = chunk if size >= len(chunk) else chunk[:size]
        os.write(fd, piece)
        size -= len(piece)


def _build(path: Path, size: int, after_failure: int, chunk: bytes) -> None:
    failure = FAILURE.read_bytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_filler(fd, size - after_failure - len(failure), chunk)
        os.write(fd, failure)
        _write_filler(fd, after_failure, chunk)
    finally:
        os.close(fd)


def _time_in_process(path: Path) -> tuple[float, str]:
    started = time.perf_counter()
    verdict = diagnose(Evidence(log=scan_log(path)), History())
    return time.perf_counter() - started, f"{verdict.kind.value} rank {verdict.rank}"


def _time_command(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=False, timeout=3600)
    return time.perf_counter() - started


def _sizes() -> tuple[float, ...]:
    text = os.environ.get("BENCH_SIZES_GB")
    if not text:
        return DEFAULT_SIZES_GB
    return tuple(float(part) for part in text.split(",") if part.strip())


def main() -> None:
    directory = Path(os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    script = str(Path(sys.executable).with_name("slurm-medic"))
    chunk = _filler_chunk()
    print(f"logs in {directory}; times in seconds (in-process = scan + diagnose)")
    print(
        f"{'size':>6} {'failure':>14} {'in-process':>11} {'cli --json':>11} {'grep -n':>9}  verdict"
    )
    for size_gb in _sizes():
        size = int(size_gb * GB)
        free = shutil.disk_usage(directory).free
        if free < size + SPARE_BYTES:
            print(f"{size_gb:>5g}G skipped: {free / GB:.1f} GB free, needs {size_gb + 1:g} GB")
            continue
        failure_size = FAILURE.stat().st_size
        for wanted_label, wanted_after in (("at the end", 0), ("1 GB before", GB)):
            after = min(wanted_after, size - failure_size)
            label = wanted_label if after == wanted_after else "at the start"
            path = directory / f"slurm-medic-bench-{size_gb:g}g.log"
            try:
                _build(path, size, after, chunk)
                seconds, verdict = _time_in_process(path)
                cli = _time_command([script, "diagnose", "--log", str(path), "--json"])
                grep = _time_command(["grep", "-n", "-F", "CUDA out of memory", str(path)])
                print(
                    f"{size_gb:>5g}G {label:>14} {seconds:>11.3f} {cli:>11.3f} {grep:>9.3f}"
                    f"  {verdict}",
                    flush=True,
                )
            finally:
                path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
