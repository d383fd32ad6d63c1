"""The example templates on the real local cluster: sbatch accepts each rendered script, each
runs to the end, writes checkpoints that checkpoint discovery finds, and resumes from one; and
a planned fix, rendered into a new revision, makes a failing emulated run pass."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon import process
from daemon.checkpoints import find_last_good
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.planner import LineageHistory, PlannerPolicy, Proposal, plan
from daemon.templates.model import LaunchTemplate, validate_knobs
from daemon.templates.reading import load_template
from daemon.templates.revisions import apply_patch, initial_revision, resume_patch
from tests.devcluster import user_dir, wait_for_end

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
END_WITHIN_S = 120


@pytest.fixture
def work_dir() -> Iterator[Path]:
    with user_dir("medic-templates", USER) as path:
        yield path


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
    state = wait_for_end(job_id, END_WITHIN_S)
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
    assert wait_for_end(job_id, END_WITHIN_S) == "COMPLETED", log.read_text()
    assert "OutOfMemoryError" not in log.read_text()


def run_to_end(template: LaunchTemplate, work_dir: Path, script: str) -> tuple[str, str]:
    submitted = sbatch(work_dir, script, "--parsable")
    assert submitted.ok, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    state = wait_for_end(job_id, END_WITHIN_S)
    log = work_dir / f"{template.sbatch[0][1]}-{job_id}.out"
    return state, log.read_text() if log.exists() else ""


def with_knobs(template: LaunchTemplate, **changes: object) -> LaunchTemplate:
    return dataclasses.replace(
        template, knobs=validate_knobs(template.dialect, {**template.knobs, **changes})
    )


def scenario_env(template: LaunchTemplate, scenario: str, **extra: str) -> dict[str, str]:
    env = dict(template.knobs["env"])  # type: ignore[arg-type]
    env.update(EMULATION_SCENARIO=scenario, **extra)
    return env


@pytest.mark.parametrize(
    ("example", "scenario", "kind", "knobs", "expected"),
    [
        (
            "hf-trainer",
            "true-oom-step0",
            FailureKind.TRUE_OOM,
            {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 4},
            "micro_batch_down",
        ),
        (
            "torchrun",
            "fragmentation",
            FailureKind.FRAGMENTATION,
            {},
            "allocator_expandable_segments",
        ),
    ],
)
def test_the_planned_fix_makes_the_emulated_run_pass(
    example: str,
    scenario: str,
    kind: FailureKind,
    knobs: dict[str, object],
    expected: str,
    work_dir: Path,
) -> None:
    """Fail on the cluster, plan from a diagnosis of that kind, relaunch the new revision
    from the last good checkpoint, and finish."""
    base = with_knobs(localised(example, work_dir), **knobs)
    template = with_knobs(base, env=scenario_env(base, scenario))
    first = initial_revision(template)
    state, log = run_to_end(template, work_dir, first.script)
    assert state == "FAILED", log
    assert "torch.OutOfMemoryError: CUDA out of memory" in log

    diagnosis = Diagnosis(
        kind=kind, confidence=Confidence.HIGH, reasons=("cluster test",), onset=Onset.STEP0, step=0
    )
    proposal = plan(diagnosis, template, LineageHistory(), PlannerPolicy())
    assert isinstance(proposal, Proposal)
    assert proposal.remediation.remediator == expected
    fixed = apply_patch(template, first, proposal.patch)
    geometry = template.dialect.geometry
    assert geometry(fixed.knobs).global_batch == geometry(first.knobs).global_batch
    assert template.checkpoint is not None
    scan = find_last_good(template.checkpoint)
    if scan.found is not None:
        patched = dataclasses.replace(template, knobs=fixed.knobs)
        fixed = apply_patch(patched, fixed, resume_patch(patched, fixed.knobs, scan.found))
    state, log = run_to_end(template, work_dir, fixed.script)
    assert state == "COMPLETED", log
    assert "OutOfMemoryError" not in log
