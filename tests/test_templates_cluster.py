"""The example templates on the real local cluster: sbatch accepts each rendered script, each
runs to the end, writes checkpoints that checkpoint discovery finds, and resumes from one."""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon import process
from daemon.checkpoints import find_last_good
from daemon.templates import (
    LaunchTemplate,
    apply_patch,
    initial_revision,
    load_template,
    resume_patch,
)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("devcluster")]

USER = "alice"
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "launch_templates"
EMULATED_TRAIN = str(ROOT / "deploy" / "devcluster" / "emulated-train")
OUTPUT_VARIABLE = {
    "hf-trainer": "output_dir",
    "megatron": "save_dir",
    "deepspeed": "save_dir",
    "torchrun": "checkpoint_dir",
}
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture
def work_dir() -> Iterator[Path]:
    path = Path(f"/tmp/medic-templates-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    shutil.chown(path, USER, USER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def localised(example: str, work_dir: Path) -> LaunchTemplate:
    """The example with this machine's program path and a directory alice can write."""
    template = load_template(EXAMPLES / example)
    out = str(work_dir / "ckpt")
    variables = dict(template.variables)
    variables["program"] = (EMULATED_TRAIN,)
    variables[OUTPUT_VARIABLE[example]] = out
    env = dict(template.knobs["env"])  # type: ignore[arg-type]
    env.update(EMULATION_STEP_SECONDS="0.05", EMULATION_NCCL_TIMEOUT_SECONDS="5")
    knobs = {**template.knobs, "env": tuple(sorted(env.items()))}
    sbatch = dict(template.sbatch)
    sbatch["output"] = f"{work_dir}/%x-%j.out"
    assert template.checkpoint is not None
    return dataclasses.replace(
        template,
        knobs=knobs,
        variables=tuple(variables.items()),
        sbatch=tuple(sbatch.items()),
        checkpoint=dataclasses.replace(template.checkpoint, root=out),
    )


def sbatch(work_dir: Path, script: str, *extra: str) -> process.CommandResult:
    path = work_dir / f"job-{uuid.uuid4().hex[:6]}.sh"
    path.write_text(script)
    argv = ["sbatch", f"--uid={USER}", f"--gid={USER}", f"--chdir={work_dir}", *extra, str(path)]
    return process.run(argv, timeout=30)


def wait_for_end(job_id: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = process.run(["scontrol", "show", "job", "-o", job_id], timeout=15)
        match = re.search(r"\bJobState=(\S+)", shown.stdout)
        if match and match.group(1) in TERMINAL:
            return match.group(1)
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end within {timeout_s} s")


@pytest.mark.parametrize("example", sorted(OUTPUT_VARIABLE))
def test_example_is_accepted_runs_checkpoints_and_resumes(example: str, work_dir: Path) -> None:
    template = localised(example, work_dir)
    first = initial_revision(template)
    test_only = sbatch(work_dir, first.script, "--test-only")
    assert test_only.ok, test_only.stderr
    assert "to start at" in test_only.stderr

    submitted = sbatch(work_dir, first.script, "--parsable")
    assert submitted.ok, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = work_dir / f"{template.sbatch[0][1]}-{job_id}.out"
    state = wait_for_end(job_id)
    assert state == "COMPLETED", log.read_text() if log.exists() else state

    assert template.checkpoint is not None
    scan = find_last_good(template.checkpoint)
    assert scan.found is not None, scan.reason
    assert scan.skipped == ()

    resumed = apply_patch(template, first, resume_patch(template, first.knobs, scan.found))
    assert scan.found.resume_path in resumed.script
    submitted = sbatch(work_dir, resumed.script, "--parsable")
    assert submitted.ok, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = work_dir / f"{template.sbatch[0][1]}-{job_id}.out"
    assert wait_for_end(job_id) == "COMPLETED", log.read_text()
    assert "OutOfMemoryError" not in log.read_text()
