"""Diagnose time on big logs against `grep -n` over the same file, in the CLI and the daemon.

Builds logs of 1, 4 and 16 GB (or `BENCH_SIZES_GB`, e.g. `BENCH_SIZES_GB=0.5,1`) made of
realistic training lines (`BENCH_FILLER=hf`, the default: HF Trainer loss dicts and tqdm bars;
or `megatron`: Megatron-LM iteration lines, whose `E+00` figures hold a trigger's rarest byte),
with a multi-rank OOM failure either at the very end or 1 GB before the end, and prints the
README's table: the in-process scan + diagnose time, the cold `slurm-medic diagnose --json`
subprocess time, the daemon's reader (`OwnerFiles.scan_log`: a `setpriv` child as the user
`BENCH_OWNER`, default alice, when run as root; in-process otherwise), `grep -n -F 'CUDA out of
memory'` over the same file, and the scan's read rate (bytes it read back / its seconds) beside
grep's. Then the cascade case: a root OOM followed by the cascade of a 4,096-rank job (NCCL
watchdog timeouts with their C++ backtraces for several process groups per rank, torchrun's
SIGTERM lines and failure tables), about 200 MB (`BENCH_CASCADE_MB`), found by the CLI and
through the daemon's reader. Sizes that do not fit on the disk (with 1 GB to spare) are
skipped, saying so; every file is deleted. Files are written into `BENCH_DIR` (default: the
system temporary directory) and are still in the page cache when read, as a fresh log of a job
that just died would be.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from daemon.diagnosis import History
from daemon.evidence.joblog import DEFAULT_BLOCK_SIZE, scan_log
from daemon.evidence.log_lines import is_root_candidate
from daemon.evidence.log_reader import Cursor, FarLines, FdReader, lines_backward
from daemon.evidence.records import Evidence, LogFindings
from daemon.owner_files import Owner, OwnerFiles
from daemon.rules.dispatch import diagnose

GB = 1024**3
MB = 1024**2
CHUNK_BYTES = 64 * 1024 * 1024
SPARE_BYTES = GB
DEFAULT_SIZES_GB = (1.0, 4.0, 16.0)
FAILURE = Path(__file__).parents[1] / "data" / "logs" / "torchrun_multirank_backward_oom.log"
CASCADE_RANKS = 4096
ROOT_RANK = 3  # the failing rank of FAILURE, whose traceback precedes the cascade
GPUS_PER_NODE = 8
LIB = "/opt/venv/lib/python3.11/site-packages/torch/lib"


def _hf_lines(step: int) -> str:
    return (
        f"0: [rank0]: {{'loss': {2.0 - step / 1e5:.4f}, 'grad_norm': 0.93, "
        f"'learning_rate': 1.98e-05, 'epoch': {step / 20_000:.2f}}}\n"
        f"0:  {step // 200:2d}%|##        | {step}/20000 [05:31<41:17,  2.81s/it]\n"
    )


def _megatron_lines(step: int) -> str:
    return (
        f" [2025-10-02 12:20:48] iteration {step:8d}/  250000 | consumed samples: {step * 128:12d}"
        " | elapsed time per iteration (ms): 1234.5 | learning rate: 1.498E-04 | global batch"
        f" size:   128 | lm loss: {7.5 - step / 1e5:.6E} | loss scale: 1.0 | grad norm: 1.234 |"
        " number of skipped iterations:   0 | number of nan iterations:   0 |\n"
    )


FILLERS: dict[str, Callable[[int], str]] = {"hf": _hf_lines, "megatron": _megatron_lines}


def _filler_chunk(lines: Callable[[int], str] = _hf_lines) -> bytes:
    block = "".join(lines(step) for step in range(20_000)).encode()
    repeat = CHUNK_BYTES // len(block) + 1
    return (block * repeat)[:CHUNK_BYTES].rsplit(b"\n", 1)[0] + b"\n"


def _write_filler(fd: int, size: int, chunk: bytes) -> None:
    while size > 0:
        piece = chunk if size >= len(chunk) else chunk[:size]
        os.write(fd, piece)
        size -= len(piece)


def _build(path: Path, size: int, after_failure: int, chunk: bytes) -> None:
    failure = FAILURE.read_bytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_filler(fd, size - after_failure - len(failure), chunk)
        os.write(fd, failure)
        _write_filler(fd, after_failure, chunk)
    finally:
        os.close(fd)


def _watchdog_dump(rank: int, group: int, second: int) -> str:
    """One process group's watchdog timeout on one rank, as torch 2.4 prints it (glog prefix,
    `[PG n Rank m]`, the C++ backtraces of `checkTimeout` and of the watchdog's rethrow)."""
    local = rank % GPUS_PER_NODE
    stamp = f"[rank{rank}]:[E1120 14:37:{second:02d}.{rank * 7919 % 10**9:09d} {80_000 + rank}"
    work = (
        f"WorkNCCL(SeqNum={1580 + group}, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168,"
        " Timeout(ms)=600000) ran for 600059 milliseconds before timing out."
    )
    address = f"{0x7F3A00000000 + rank * 0x1000 + group:#x}"
    frames = "".join(
        f"frame #{index}: {name} + {0x57 + index:#x} ({address} in {LIB}/{library})\n"
        for index, (name, library) in enumerate(
            [
                ("c10::Error::Error(c10::SourceLocation, std::string)", "libc10.so"),
                (
                    "c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<>)",
                    "libtorch_cuda.so",
                ),
                ("c10d::ProcessGroupNCCL::watchdogHandler()", "libtorch_cuda.so"),
                ("c10d::ProcessGroupNCCL::ncclCommWatchdog()", "libtorch_cuda.so"),
                ("<unknown function>", "../../../.././libstdc++.so.6"),
            ]
        )
    )
    return (
        f"{stamp} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective operation"
        f" timeout: {work}\n"
        f"{stamp} ProcessGroupNCCL.cpp:1785] [PG {group} Rank {local}] Exception (either an error"
        f" or timeout) detected by watchdog at work: {1580 + group}, last enqueued NCCL work:"
        f" {1582 + group}, last completed NCCL work: {1579 + group}.\n"
        f"{stamp} ProcessGroupNCCL.cpp:1834] [PG {group} Rank {local}] Timeout at NCCL work:"
        f" {1580 + group}, last enqueued NCCL work: {1582 + group}, last completed NCCL work:"
        f" {1579 + group}.\n"
        f"{stamp} ProcessGroupNCCL.cpp:630] [Rank {rank}] Some NCCL operations have failed or timed"
        " out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run"
        " on corrupted/incomplete data.\n"
        f"{stamp} ProcessGroupNCCL.cpp:636] [Rank {rank}] To avoid data inconsistency, we are"
        " taking the entire process down.\n"
        f"{stamp} ProcessGroupNCCL.cpp:1595] [PG {group} Rank {local}] Process group watchdog"
        f" thread terminated with exception: [Rank {rank}] Watchdog caught collective operation"
        f" timeout: {work}\n"
        "Exception raised from checkTimeout at"
        " ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:618 (most recent call first):\n"
        f"{frames}\n"
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        f"  what():  [PG {group} Rank {local}] Process group watchdog thread terminated with"
        f" exception: [Rank {rank}] Watchdog caught collective operation timeout: {work}\n"
        "Exception raised from ncclCommWatchdog at"
        " ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1601 (most recent call first):\n"
        f"{frames}\n"
    )


def _agent_table(node: int) -> str:
    """A node's torchrun agent: the SIGTERMs it sent and its ChildFailedError table."""
    lines = [
        f"W1120 14:38:01.000000 {9000 + node} torch/distributed/elastic/multiprocessing/api.py:897]"
        f" Sending process {80_000 + node * GPUS_PER_NODE + local} closing signal SIGTERM\n"
        for local in range(GPUS_PER_NODE)
    ]
    lines.append(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\ntrain.py FAILED\n"
        "------------------------------------------------------------\n"
        "Failures:\n  <NO_OTHER_FAILURES>\n"
        "------------------------------------------------------------\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2025-11-20_14:38:02\n"
        f"  host      : gpu-{node:04d}\n  rank      : {node * GPUS_PER_NODE} (local_rank: 0)\n"
        f"  exitcode  : -6 (pid: {80_000 + node * GPUS_PER_NODE})\n  error_file: <N/A>\n"
        "  traceback : Signal 6 (SIGABRT) received by PID\n"
        "============================================================\n"
    )
    return "".join(lines)


def _cascade(size: int) -> Iterator[bytes]:
    """About `size` bytes of a 4,096-rank job's cascade after the root failure: every other
    rank's watchdog dumps (as many process groups each as the size asks), then every node's
    agent lines and table."""
    per_dump = len(_watchdog_dump(CASCADE_RANKS - 1, 0, 0))
    groups = max(1, size // (CASCADE_RANKS * per_dump))
    for rank in range(CASCADE_RANKS):
        if rank != ROOT_RANK:
            yield "".join(
                _watchdog_dump(rank, group, rank % 60) for group in range(groups)
            ).encode()
    for node in range(CASCADE_RANKS // GPUS_PER_NODE):
        yield _agent_table(node).encode()


def _build_cascade(path: Path, before: int, cascade_bytes: int, chunk: bytes) -> int:
    """Filler, the root OOM of rank 3 (the sample's traceback), the cascade, the sample's
    summary lines; returns the cascade's size."""
    failure = FAILURE.read_bytes()
    root_end = failure.index(b"\n", failure.index(b"torch.OutOfMemoryError")) + 1
    summary = failure.index(b"1: E0321")
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_filler(fd, before, chunk)
        os.write(fd, failure[:root_end])
        for piece in _cascade(cascade_bytes):
            written += os.write(fd, piece)
        os.write(fd, failure[summary:])
    finally:
        os.close(fd)
    return written


def _time_in_process(path: Path) -> tuple[float, LogFindings, str]:
    started = time.perf_counter()
    findings = scan_log(path)
    verdict = diagnose(Evidence(log=findings), History())
    return time.perf_counter() - started, findings, f"{verdict.kind.value} rank {verdict.rank}"


def _search_rate(path: Path, back: int) -> str:
    """GiB/s of the scan's search far from the end (every window searched for the triggers, no
    line read whole) over the bytes the scan read back: the rate to set beside grep's. What
    `scan + diagnose` adds is reading the tail and look-behind whole, and the analysis."""
    if back < GB // 4:
        return "-"  # a scan that read its tail only has no rate to speak of
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = FdReader(fd)
        size = reader.size
        cursor = Cursor(full_from=size + 1, lowest=0, position=size)
        started = time.perf_counter()
        for _ in lines_backward(
            reader,
            size,
            DEFAULT_BLOCK_SIZE,
            back,
            cursor,
            far=FarLines(),
            is_root=is_root_candidate,
            out_of_time=lambda: False,
        ):
            pass
        return f"{back / GB / (time.perf_counter() - started):.2f}"
    finally:
        os.close(fd)


def _time_command(argv: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, check=False, timeout=3600, text=True)
    return time.perf_counter() - started, result.stdout


def _cli(script: str, path: Path) -> tuple[float, str]:
    seconds, output = _time_command([script, "diagnose", "--log", str(path), "--json"])
    try:
        document = json.loads(output)
    except json.JSONDecodeError:
        return seconds, "no verdict"
    return seconds, f"{document.get('kind')} rank {document.get('rank')}"


def _daemon_reader() -> tuple[str, OwnerFiles, Owner | None]:
    """The daemon's `OwnerFiles`: a setpriv child as a local user when root, else this process."""
    if os.geteuid() == 0:
        name = os.environ.get("BENCH_OWNER", "alice")
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            pass
        else:
            owner = Owner(entry.pw_name, entry.pw_uid, entry.pw_gid)
            return f"setpriv child as {name}", OwnerFiles(owner, drop_privileges=True), owner
    return "in-process (not root)", OwnerFiles.as_caller(), None


def _time_daemon(files: OwnerFiles, owner: Owner | None, path: Path) -> tuple[float, str]:
    if owner is not None:
        os.chown(path, owner.uid, owner.gid)
    started = time.perf_counter()
    findings = files.scan_log(str(path))
    seconds = time.perf_counter() - started
    return seconds, f"rank {findings.rank}"


def _sizes() -> tuple[float, ...]:
    text = os.environ.get("BENCH_SIZES_GB")
    if not text:
        return DEFAULT_SIZES_GB
    return tuple(float(part) for part in text.split(",") if part.strip())


def _gb_per_s(size: int, seconds: float) -> str:
    return f"{size / GB / seconds:.2f}" if seconds > 0 else "-"


def main() -> None:
    directory = Path(os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    script = str(Path(sys.executable).with_name("slurm-medic"))
    filler = os.environ.get("BENCH_FILLER", "hf")
    chunk = _filler_chunk(FILLERS[filler])
    reader, files, owner = _daemon_reader()
    print(
        f"logs in {directory} ({filler} filler); seconds; daemon's reader: {reader}; search"
        " GiB/s: the scan's search far from the end over the bytes it read back; grep GiB/s:"
        " grep's over the whole file"
    )
    print(
        "| log | failure | scan + diagnose | `slurm-medic diagnose --json` | daemon's reader"
        " | `grep -n -F` | read back | search GiB/s | grep GiB/s | verdicts |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size_gb in _sizes():
        size = int(size_gb * GB)
        free = shutil.disk_usage(directory).free
        if free < size + SPARE_BYTES:
            print(f"{size_gb:g} GB skipped: {free / GB:.1f} GB free, needs {size_gb + 1:g} GB")
            continue
        failure_size = FAILURE.stat().st_size
        for wanted_label, wanted_after in (("at the end", 0), ("1 GB before the end", GB)):
            after = min(wanted_after, size - failure_size)
            label = wanted_label if after == wanted_after else "at the start"
            path = directory / f"slurm-medic-bench-{size_gb:g}g.log"
            try:
                _build(path, size, after, chunk)
                seconds, findings, verdict = _time_in_process(path)
                search = _search_rate(path, findings.bytes_scanned)
                cli, cli_verdict = _cli(script, path)
                daemon, daemon_verdict = _time_daemon(files, owner, path)
                grep, _ = _time_command(["grep", "-n", "-F", "CUDA out of memory", str(path)])
                print(
                    f"| {size_gb:g} GB | {label} | {seconds:.3f} | {cli:.3f} | {daemon:.3f}"
                    f" | {grep:.3f} | {findings.bytes_scanned / MB:.0f} MiB | {search}"
                    f" | {_gb_per_s(size, grep)} | {verdict}; cli {cli_verdict};"
                    f" daemon {daemon_verdict} |",
                    flush=True,
                )
            finally:
                path.unlink(missing_ok=True)
    _bench_cascade(directory, chunk, script, files, owner)


def _bench_cascade(
    directory: Path, chunk: bytes, script: str, files: OwnerFiles, owner: Owner | None
) -> None:
    cascade_bytes = int(float(os.environ.get("BENCH_CASCADE_MB", "200")) * MB)
    path = directory / "slurm-medic-bench-cascade.log"
    try:
        written = _build_cascade(path, 64 * MB, cascade_bytes, chunk)
        size = path.stat().st_size
        seconds, findings, verdict = _time_in_process(path)
        cli, cli_verdict = _cli(script, path)
        daemon, daemon_verdict = _time_daemon(files, owner, path)
        grep, _ = _time_command(["grep", "-n", "-F", "CUDA out of memory", str(path)])
        print(
            f"cascade: root OOM of rank {ROOT_RANK}, then {written / MB:.0f} MB of a"
            f" {CASCADE_RANKS}-rank cascade ({size / MB:.0f} MB log): scan + diagnose"
            f" {seconds:.3f} s ({verdict}, {findings.bytes_scanned / MB:.0f} MB read back),"
            f" `slurm-medic diagnose --json` {cli:.3f} s ({cli_verdict}), daemon's reader"
            f" {daemon:.3f} s ({daemon_verdict}), `grep -n -F` {grep:.3f} s",
            flush=True,
        )
        for note in findings.notes:
            print(f"  note: {note}")
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
