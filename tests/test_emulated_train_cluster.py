"""The emulated run on the real 4-node cluster: one rank's OOM fails the job, the fix passes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devcluster import sbatch_as, user_dir, wait_for_end

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("devcluster")]

USER = "alice"
EMULATED_TRAIN = Path(__file__).resolve().parent.parent / "deploy" / "devcluster" / "emulated-train"
# The budget for a job to end allows for other sessions' jobs holding the nodes.
END_WITHIN_S = 240


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A directory alice can write her log and checkpoints into (tmp_path is root-only)."""
    with user_dir("medic-emulated-train", USER) as path:
        yield path


def submit(work_dir: Path, name: str, env_line: str, train_args: list[str]) -> str:
    script = work_dir / f"{name}.sh"
    command = " ".join([str(EMULATED_TRAIN), *train_args])
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=4\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --output={work_dir}/%x-%j.out\n"
        f"{env_line}\n"
        f"srun {command}\n"
    )
    return sbatch_as(USER, work_dir, name, script)


def test_fragmentation_wedges_then_fails_and_expandable_segments_resumes_to_the_end(
    work_dir: Path,
) -> None:
    out = work_dir / "out"
    train_args = [
        "--dialect",
        "hf",
        "--scenario",
        "fragmentation",
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--save_steps",
        "2",
        "--step-seconds",
        "0.1",
        "--nccl-timeout-seconds",
        "3",
        "--report_to",
        "none",
    ]
    failed_id = submit(work_dir, "frag", "export PYTORCH_CUDA_ALLOC_CONF=", train_args)
    assert wait_for_end(failed_id, END_WITHIN_S) == "FAILED"
    log = (work_dir / f"frag-{failed_id}.out").read_text()
    assert (
        log.splitlines()[0]
        == "[emulated-train] EMULATION: no GPU is used; memory figures are modelled"
    )
    ooms = re.findall(
        r"^\[rank(\d)\]: torch\.OutOfMemoryError: CUDA out of memory\. .*$", log, re.MULTILINE
    )
    assert ooms == ["3"]
    assert "srun: error: gpu-04: task 3: Exited with exit code 1" in log
    watchdogs = re.findall(
        r"\[Rank (\d)\] Watchdog caught collective operation timeout: .*Timeout\(ms\)=3000\)", log
    )
    assert sorted(watchdogs) == ["0", "1", "2"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]

    fixed_id = submit(
        work_dir,
        "frag-fixed",
        "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        [*train_args, "--resume_from_checkpoint", str(out / "checkpoint-2")],
    )
    assert wait_for_end(fixed_id, END_WITHIN_S) == "COMPLETED"
    log = (work_dir / f"frag-fixed-{fixed_id}.out").read_text()
    assert "  Continuing training from global step 2" in log
    assert "OutOfMemoryError" not in log
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()
