"""The real training run on the real cluster, four ranks on two nodes: a real wedge.

The loop around it (the daemon's wedge check, diagnosis, relaunch and resume, and the real
cgroup kill of a host-RAM run) is tested by the end-to-end, service and crash sets.

Jobs run as alice under the project's venv (built on the system Python, which she may run).
`--overcommit` lets a job take one core per task, so several sessions' jobs run side by side
on the 2-core nodes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from realtrain.runner import BANNER

from daemon.diagnosis import FailureKind, History
from daemon.evidence.joblog import scan_log
from daemon.evidence.records import Evidence
from daemon.rules.dispatch import diagnose
from daemon.watch import root_failure_seen
from tests.devcluster import job_state, sbatch_as, user_dir, wait_for_end

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("devcluster")]

USER = "alice"
REPO = Path(__file__).resolve().parent.parent
REAL_TRAIN = REPO / "deploy" / "devcluster" / "real-train"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# The budget for a job to end allows for other sessions' jobs holding the nodes.
END_WITHIN_S = 300
TIMEOUT_S = 8


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A directory alice can write her log and checkpoints into (tmp_path is root-only)."""
    with user_dir("medic-real-train", USER) as path:
        yield path


def submit(work_dir: Path, name: str, env: dict[str, str]) -> str:
    exports = "".join(f"export {key}={value}\n" for key, value in env.items())
    script = work_dir / f"{name}.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2\n"
        "#SBATCH --ntasks-per-node=2\n"
        "#SBATCH --overcommit\n"
        f"#SBATCH --output={work_dir}/%x-%j.out\n"
        f"{exports}"
        f"srun {VENV_PYTHON} {REAL_TRAIN}\n"
    )
    return sbatch_as(USER, work_dir, name, script)


def wait_for_text(path: Path, pattern: re.Pattern[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if pattern.search(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{path} did not show {pattern.pattern!r} within {timeout_s} s")


def test_a_four_rank_two_node_job_wedges_in_the_real_collective_then_fails_by_itself(
    work_dir: Path,
) -> None:
    ckpt = work_dir / "ckpt"
    env = {
        "EMULATION_SCENARIO": "fragmentation",
        "EMULATION_NCCL_TIMEOUT_SECONDS": str(TIMEOUT_S),
        "EMULATION_STEP_SECONDS": "0.2",
        "MAX_STEPS": "6",
        "SAVE_EVERY": "2",
        "CKPT_DIR": str(ckpt),
        "NUM_WORKERS": "1",
    }
    job_id = submit(work_dir, "real-frag", env)
    log = work_dir / f"real-frag-{job_id}.out"
    wait_for_text(log, re.compile(r"^\[rank3\]: torch\.OutOfMemoryError: ", re.M), END_WITHIN_S)
    # Wedged: rank 3 is dead, the others wait in DDP's allreduce; the job is still running and
    # the daemon's wedge check sees the root failure in the running job's log.
    assert job_state(job_id) == "RUNNING"
    assert root_failure_seen(scan_log(log))

    assert wait_for_end(job_id, END_WITHIN_S) == "FAILED"
    text = log.read_text()
    assert text.splitlines()[0] == BANNER
    assert re.findall(
        r"^\[rank(\d)\]: torch\.OutOfMemoryError: CUDA out of memory\.", text, re.M
    ) == ["3"]
    gloo_timeout = re.compile(
        r"\[rank(\d)\]: RuntimeError: \[\S+gloo/transport/tcp/\w+\.cc:\d+\] "
        rf"Timed out waiting {TIMEOUT_S * 1000}ms for (?:recv|send) operation to complete"
    )
    lines = text.splitlines()
    timeouts = [match[1] for match in map(gloo_timeout.fullmatch, lines) if match]
    assert sorted(timeouts) == ["0", "1", "2"]
    assert "Connection closed by peer" not in text
    srun_line = re.compile(r"srun: error: gpu-02: tasks? (?:2-)?3: Exited with exit code 1")
    assert any(map(srun_line.fullmatch, lines))
    assert sorted(path.name for path in ckpt.iterdir()) == ["step_2"]
    assert sorted(path.name for path in (ckpt / "step_2").iterdir()) == [
        ".metadata",
        *(f"__{rank}_0.distcp" for rank in range(4)),
    ]
    verdict = diagnose(Evidence(log=scan_log(log), expandable_segments=False), History())
    assert (verdict.kind, verdict.rank, verdict.node) == (FailureKind.FRAGMENTATION, 3, "gpu-02")
