#!/usr/bin/env python3
"""medic-node-probe: the one fixed, read-only program slurm-medic's SSH key may run on a node.

It runs four tools, each with a timeout and an output cap, and prints ONE JSON document
holding each tool's raw stdout, stderr and exit code. It interprets nothing: parsing and
judgement happen in the daemon, where they are tested. It honours no arguments and no
SSH_ORIGINAL_COMMAND: whatever the client asks for, this is all it ever runs.

Standard library only, Python 3.6+, so it runs on any node as it is: `slurm-medic install
node-probe` writes this very file, and the `medic-node-probe` console script runs its `main`.
Hence no `from __future__ import annotations` (3.7) and typing's generics, not the builtins'
(3.9): the annotations are evaluated on 3.6.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Tuple

FORMAT = "medic-node-probe/1"
TOOL_TIMEOUT_S = 15.0
# dmesg keeps its newest lines (the job's window is at the end); the rest keep their head.
MAX_STDOUT_BYTES = 4 * 1024 * 1024
MAX_STDERR_BYTES = 16 * 1024
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Set by sshd's SetEnv on the dev cluster's nodes (clients cannot set them:
# PermitUserEnvironment no); they point the fixture tools at the node's state.
PASSED_ENV = ("MEDIC_NODE", "MEDIC_FIXTURE_DIR")

TOOLS: Tuple[Tuple[str, List[str], str], ...] = (
    ("kernel_log", ["dmesg", "--time-format", "iso"], "tail"),
    ("gpu_health", ["nvidia-smi", "-q", "-d", "ROW_REMAPPER,ECC,PAGE_RETIREMENT"], "head"),
    (
        "gpus",
        [
            "nvidia-smi",
            "--query-gpu=index,uuid,pci.bus_id,memory.total,memory.used",
            "--format=csv,noheader",
        ],
        "head",
    ),
    (
        "compute_apps",
        [
            "nvidia-smi",
            "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
            "--format=csv,noheader",
        ],
        "head",
    ),
)
JOURNAL_FALLBACK = ["journalctl", "-k", "-o", "short-iso", "--no-pager", "-n", "20000"]


def cap(data: bytes, limit: int, keep: str) -> Tuple[bytes, bool]:
    if len(data) <= limit:
        return data, False
    return (data[-limit:] if keep == "tail" else data[:limit]), True


def tool_env(path: str) -> Dict[str, str]:
    env = {"PATH": path, "LC_ALL": "C", "LANG": "C"}
    env.update({name: os.environ[name] for name in PASSED_ENV if name in os.environ})
    return env


def run_tool(argv: List[str], keep: str, path: str) -> Dict[str, Any]:
    """Run argv (no shell) in its own session; kill the whole group when it overruns."""
    executable = shutil.which(argv[0], path=path)
    result: Dict[str, Any] = {
        "argv": argv,
        "exit_code": None,
        "stdout": "",
        "stderr": "",
        "timed_out": False,
    }
    if executable is None:
        result["error"] = f"{argv[0]} not found on PATH"
        return result
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            [executable, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=tool_env(path),
        )
    except OSError as error:
        result["error"] = f"cannot start {argv[0]}: {error.strerror}"
        return result
    try:
        out, err = process.communicate(timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            out, err = process.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            out, err = b"", b""
        result["timed_out"] = True
    out, out_cut = cap(out, MAX_STDOUT_BYTES, keep)
    err, _ = cap(err, MAX_STDERR_BYTES, "tail")
    result.update(
        exit_code=process.returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        truncated=out_cut,
        duration_s=round(time.monotonic() - started, 3),
    )
    return result


def main() -> int:
    # The node's own PATH comes from sshd (SetEnv in the dev cluster); anything else falls
    # back to the system directories. No other environment reaches the tools.
    path = os.environ.get("PATH") or SAFE_PATH
    results: Dict[str, Dict[str, Any]] = {}

    def work(name: str, argv: List[str], keep: str) -> None:
        outcome = run_tool(argv, keep, path)
        if name == "kernel_log" and (outcome.get("error") or outcome["exit_code"] != 0):
            fallback = run_tool(JOURNAL_FALLBACK, keep, path)
            if not fallback.get("error") and fallback["exit_code"] == 0:
                fallback["fallback_from"] = outcome
                outcome = fallback
        results[name] = outcome

    threads = [threading.Thread(target=work, args=tool) for tool in TOOLS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    document = {
        "format": FORMAT,
        "hostname": socket.gethostname(),
        "node": os.environ.get("MEDIC_NODE", ""),
        "collected_at": datetime.now(timezone.utc).isoformat(),
        "tools": results,
    }
    sys.stdout.write(json.dumps(document))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
