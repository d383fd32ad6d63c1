"""What reading as the job's owner costs: a setpriv child per read against reading in-process.

A 256 MiB log of training progress lines with a real multi-rank OOM at its end (the scanner
reads only the end), a Hugging Face checkpoint tree of 50 checkpoints, and a launch template
directory. Then the component walk against the kernel's own lookup (`LocalReader`) on a tree of
1,000 half-written checkpoints, in-process. Needs root and the local user `alice`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from daemon.checkpoints import CheckpointLayout, CheckpointSpec, find_last_good
from daemon.owner_files import Owner, OwnerFiles
from tests.bench.bench_templates import checkpoint_tree

DATA = Path(__file__).parents[1] / "data" / "logs" / "torchrun_multirank_backward_oom.log"
TEMPLATE = Path(__file__).parents[2] / "launch_templates" / "torchrun"
LOG_BYTES = 256 * 1024 * 1024
CHECKPOINTS = 50
RUNS = 15


def _median_ms(action: Callable[[], object]) -> float:
    samples = []
    for _ in range(RUNS):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def _tree(root: Path, owner: Owner) -> None:
    for step in range(1, CHECKPOINTS + 1):
        checkpoint = root / f"checkpoint-{step * 100}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(f'{{"global_step": {step * 100}}}')
        (checkpoint / "model.safetensors").write_bytes(b"w")
    for path in [root, *root.rglob("*")]:
        os.chown(path, owner.uid, owner.gid)


def main() -> None:
    if os.geteuid() != 0:
        print("skipped: reading as the owner needs root")
        return
    try:
        entry = pwd.getpwnam("alice")
    except KeyError:
        print("skipped: no local user alice")
        return
    owner = Owner(entry.pw_name, entry.pw_uid, entry.pw_gid)
    parent = Path(tempfile.mkdtemp(prefix="bench-owner-", dir="/tmp"))
    try:
        parent.chmod(0o755)
        log = parent / "train.log"
        tail = DATA.read_bytes()
        progress = b"".join(tail.splitlines(keepends=True)[:8])
        with log.open("wb") as handle:
            for _ in range((LOG_BYTES - len(tail)) // len(progress)):
                handle.write(progress)
            handle.write(tail)
        os.chown(log, owner.uid, owner.gid)
        _tree(parent / "out", owner)
        spec = CheckpointSpec(CheckpointLayout.HF, str(parent / "out"))
        shutil.copytree(TEMPLATE, parent / "tpl")
        child = OwnerFiles(owner, drop_privileges=True)
        here = OwnerFiles(owner, drop_privileges=False)
        print(
            f"log {LOG_BYTES // 2**20} MiB, OOM at its end; {CHECKPOINTS} HF checkpoints; "
            f"median of {RUNS}"
        )
        for label, files in (("as owner (setpriv child)", child), ("in-process", here)):
            scan = _median_ms(partial(files.scan_log, str(log)))
            read = _median_ms(partial(files.read_tail, str(log), 1024 * 1024))
            found = _median_ms(partial(files.find_last_good, spec))
            template = _median_ms(partial(files.read_template, str(parent / "tpl")))
            print(
                f"{label}: scan_log {scan:.1f} ms, read_tail 1 MiB {read:.1f} ms,"
                f" find_last_good {found:.1f} ms, read_template {template:.1f} ms"
            )
        checkpoint_tree(parent / "half", 1_000)
        half = CheckpointSpec(CheckpointLayout.HF, str(parent / "half"))
        walk = _median_ms(partial(OwnerFiles.as_caller().find_last_good, half))
        lookup = _median_ms(partial(find_last_good, half))
        print(
            f"1,000 half-written checkpoints in-process: component walk {walk:.1f} ms,"
            f" kernel lookup (LocalReader) {lookup:.1f} ms"
        )
    finally:
        shutil.rmtree(parent)


if __name__ == "__main__":
    main()
