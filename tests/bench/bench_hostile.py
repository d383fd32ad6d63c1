"""Seconds and peak memory of the hostile logs (issue 10) and of the importer's worst inputs
(issue 23), each read in a child of its own.

For each input: the scan and diagnosis in a fresh Python child, and the whole CLI
(`slurm-medic diagnose --log F --json`), each timed from start to exit and measured by its
`ru_maxrss` (from `wait4`, so per child). The interpreter and the project's imports are part
of every figure; the `empty` row shows how much. The first four inputs are the before-stop
hook's reproducers byte for byte (`tests/test_hostile_logs.py` runs them through the pure
functions); the rest are the other shapes whose work the scanner bounds. Each file is written
to `BENCH_DIR` (default: the system temporary directory) and deleted afterwards.

The importer's inputs (`tests.importer_corpus`: the TOML table expression's `[` and blanks in a
script's here-document, cubic before; a YAML key's blanks; the script ending in `&&`, a
traceback before; a realistic script of 985 KB; one input per other reader) each go through
`slurm-medic template analyse FILE --json` in a directory of their own. Outcome: `report` when
the command printed its JSON document, else its exit code (3: the importer refused the input
with its own error, which the command reports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.importer_corpus import AND_AND_SCRIPT, HOSTILE_SCRIPTS, large_script

CHILD_SECONDS = 120  # a child still running after this is killed and reported as such
HOOK_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
    " capacity of 79.19 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process"
    " has 78.10 GiB memory in use. Of the allocated memory 70.00 GiB is allocated by PyTorch, and"
    " 7.50 GiB is reserved by PyTorch but unallocated."
)
TASK_LINE = "srun: error: gpu-01: tasks " + "0-4095," * 12_000 + "0: Exited with exit code 1"
# Short enough to be matched whole: 1,100 ranges of 4,096 tasks (4.5 million once expanded).
MATCHED_TASK_LINE = "srun: error: gpu-01: tasks " + "0-4095," * 1_100 + "0: Exited with exit code 1"

# The before-stop hook's four, as it writes them.
TASK_LIST_LOG = f"{HOOK_MESSAGE}\n{TASK_LINE}\n"
DIGIT_RUNS_LOG = ("torch.OutOfMemoryError: CUDA out of memory. " + "9" * 4000 + "\n") * 250
ZERO_REQUEST_LOG = (
    "CUDA out of memory.Tried to allocate 0GiB 0byte is reserved by PyTorch but unallocated\n"
)
HUGE_STEP_LOG = f"step={'7' * 5000}\n{HOOK_MESSAGE}\n"

TASK_LISTS_LOG = f"{HOOK_MESSAGE}\n{(TASK_LINE + chr(10)) * 4}{MATCHED_TASK_LINE}\n"
HUGE_NUMBERS_LOG = (
    "step=9223372036854775808\n"  # 2**63: beyond a signed 64-bit column
    "[rank2097152]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    " 2000000000.00 GiB. GPU 0 has a total capacity of -9.50 GiB of which 1.00 GiB is free."
    " Process 99999999999 has 30.00 GiB memory in use. Of the allocated memory 70.00 GiB is"
    " allocated by PyTorch, and 7.50 GiB is reserved by PyTorch but unallocated.\n"
    "srun: error: gpu-01: tasks 99999999999-99999999999999: Exited with exit code"
    " 99999999999999999999\n"
)


def _deep_traceback() -> bytes:
    frame = '  File "model.py", line 1, in forward\n    return self.block(x)\n'
    return ("Traceback (most recent call last):\n" + frame * 300_000 + HOOK_MESSAGE + "\n").encode()


HOSTILE: dict[str, Callable[[], bytes]] = {
    "task-list": TASK_LIST_LOG.encode,
    "digit-runs": DIGIT_RUNS_LOG.encode,
    "zero-request": ZERO_REQUEST_LOG.encode,
    "huge-step": HUGE_STEP_LOG.encode,
    "task-lists-x4": TASK_LISTS_LOG.encode,
    "huge-numbers": HUGE_NUMBERS_LOG.encode,
    "short-lines": lambda: b"ab\n" * (2 * 1024 * 1024),
    "trigger-lines": lambda: b"WARNING: some Error happened in a module\n" * 1_500_000,
    "deep-traceback": _deep_traceback,
    "oom-lines": lambda: f"[rank1]: {HOOK_MESSAGE}\n".encode() * 60_000,
    "nested-json": lambda: b'{"message": ' + b"[" * 400_000 + b"]" * 400_000 + b"}",
    "redraws": lambda: (b"x\r" * 60_000 + b"\n") * 20,
    "empty": bytes,
}

KB = 1024
# The importer's worst inputs: name -> the script's text.
IMPORTER: dict[str, Callable[[], str]] = {
    "empty": lambda: "#!/bin/bash\n",
    "toml-[-6KB": lambda: HOSTILE_SCRIPTS["toml-bracket-heredoc"](6 * KB),
    "toml-[-64KB": lambda: HOSTILE_SCRIPTS["toml-bracket-heredoc"](64 * KB),
    "yaml-key-64KB": lambda: HOSTILE_SCRIPTS["yaml-key-blanks-heredoc"](64 * KB),
    "yaml-interp-64KB": lambda: HOSTILE_SCRIPTS["yaml-interpolations"](64 * KB),
    "json-\\-64KB": lambda: HOSTILE_SCRIPTS["json-backslashes-heredoc"](64 * KB),
    "python-64KB": lambda: HOSTILE_SCRIPTS["python-blanks-heredoc"](64 * KB),
    "and-and": lambda: AND_AND_SCRIPT,
    "and-and-64KB": lambda: HOSTILE_SCRIPTS["and-and-trailing"](64 * KB),
    "$(-nest-64KB": lambda: HOSTILE_SCRIPTS["nested-substitutions"](64 * KB),
    "flags-64KB": lambda: HOSTILE_SCRIPTS["one-line-flags"](64 * KB),
    "growing-64KB": lambda: HOSTILE_SCRIPTS["growing-path"](64 * KB),
    "case-64KB": lambda: HOSTILE_SCRIPTS["case-branches"](64 * KB),
    "large-985KB": lambda: large_script(985_000),
    "flags-985KB": lambda: HOSTILE_SCRIPTS["one-line-flags"](985_000),
    "newlines-985KB": lambda: HOSTILE_SCRIPTS["newlines"](985_000),
    "exports-ifs-985KB": lambda: HOSTILE_SCRIPTS["exports-and-tests"](985_000),
}

# A child's ru_maxrss counts the memory of the process it was forked from (Linux keeps the
# pre-exec high-water mark), so each measured child is started by a small fresh launcher, not by
# this process, which holds the inputs it built.
_LAUNCHER = """
import json, os, subprocess, sys, threading, time
started = time.perf_counter()
child = subprocess.Popen(sys.argv[2:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
watchdog = threading.Timer(float(sys.argv[1]), child.kill)
watchdog.start()
output = child.stdout.read()
_, status, usage = os.wait4(child.pid, 0)
watchdog.cancel()
print(json.dumps({
    "seconds": time.perf_counter() - started,
    "maxrss_kib": usage.ru_maxrss,
    "code": os.waitstatus_to_exitcode(status),
    "stdout": output,
}))
"""

_CHILD = """
import sys, time
from daemon.rules.dispatch import diagnose
from daemon.evidence.joblog import scan_log
from daemon.evidence.records import Evidence
started = time.perf_counter()
verdict = diagnose(Evidence(log=scan_log(sys.argv[1])))
print(f"{time.perf_counter() - started:.3f} {verdict.kind.value}")
"""


def _measure(argv: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, peak RSS in MiB, exit code and stdout of one child, through `_LAUNCHER`."""
    result = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(CHILD_SECONDS), *argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=CHILD_SECONDS + 30,
    )
    report = json.loads(result.stdout)
    return report["seconds"], report["maxrss_kib"] / 1024, report["code"], report["stdout"]


def _scan_verdict(code: int, output: str) -> str:
    return output.rsplit(maxsplit=1)[-1] if code == 0 and output.strip() else f"exit {code}"


def _cli_verdict(code: int, output: str) -> str:
    if code != 0:
        return f"exit {code}"
    try:
        return str(json.loads(output)["kind"])
    except (ValueError, KeyError, TypeError):
        return "no verdict"


def main() -> None:
    directory = Path(os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    script = str(Path(sys.executable).with_name("slurm-medic"))
    print("seconds from start to exit; peak RSS of the child in MiB (interpreter included)")
    print(
        f"{'input':<15} {'bytes':>10} {'scan s':>7} {'scan MiB':>9} {'cli s':>7} {'cli MiB':>8}"
        "  verdict (scan; cli --json)"
    )
    _logs(directory, script)
    _importer(directory, script)


def _importer(directory: Path, script: str) -> None:
    print()
    print("the importer: slurm-medic template analyse FILE --json")
    print(f"{'input':<18} {'bytes':>10} {'cli s':>7} {'cli MiB':>8}  outcome")
    for name, build in IMPORTER.items():
        folder = Path(tempfile.mkdtemp(prefix="slurm-medic-bench-import-", dir=directory))
        path = folder / "job.sbatch"
        path.write_bytes(build().encode("utf-8", "surrogateescape"))
        try:
            seconds, mib, code, output = _measure(
                [script, "template", "analyse", str(path), "--json"]
            )
            outcome = f"exit {code}"
            if code == 0:
                try:
                    json.loads(output)
                    outcome = "report"
                except ValueError:
                    outcome = "exit 0, no JSON"
            print(
                f"{name:<18} {path.stat().st_size:>10} {seconds:>7.2f} {mib:>8.1f}  {outcome}",
                flush=True,
            )
        finally:
            path.unlink(missing_ok=True)
            folder.rmdir()


def _logs(directory: Path, script: str) -> None:
    for name, build in HOSTILE.items():
        path = directory / f"slurm-medic-bench-hostile-{name}.log"
        path.write_bytes(build())
        try:
            scan_seconds, scan_mib, scan_code, scan_out = _measure(
                [sys.executable, "-c", _CHILD, str(path)]
            )
            cli_seconds, cli_mib, cli_code, cli_out = _measure(
                [script, "diagnose", "--log", str(path), "--json"]
            )
            print(
                f"{name:<15} {path.stat().st_size:>10} {scan_seconds:>7.2f} {scan_mib:>9.1f}"
                f" {cli_seconds:>7.2f} {cli_mib:>8.1f}  {_scan_verdict(scan_code, scan_out)};"
                f" {_cli_verdict(cli_code, cli_out)}",
                flush=True,
            )
        finally:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
