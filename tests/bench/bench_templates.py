"""What the planning half of a relaunch costs: render, patch+diff, plan, loading and rendering
an imported script, checkpoint scan, and what refusing a hostile template costs (nested loops,
include, a recursive macro, huge arithmetic, too many tags: each refused from the parsed tree,
before anything runs).

Each figure is the median of several runs. The checkpoint scan is timed over real directory
trees in a temporary directory: N half-written HF checkpoints above one complete one (the worst
case: every candidate is opened before the good one is found).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from daemon.checkpoints import CheckpointLayout, CheckpointSpec, find_last_good
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.dialects.base import Role
from daemon.evidence.records import OomFamily, OomReport
from daemon.planner import Attempt, LineageHistory, Outcome, PlannerPolicy, Proposal, plan
from daemon.templates.model import LaunchTemplate, TemplateError
from daemon.templates.reading import load_template, parse_template
from daemon.templates.rendering import render
from daemon.templates.revisions import KnobChange, Patch, apply_patch, initial_revision

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "launch_templates"
DATA = ROOT / "tests" / "data" / "sbatch"
GIB = 1024**3


def median_s(action: Callable[[], object], runs: int) -> float:
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def report(what: str, seconds: float) -> None:
    print(f"{what:62} {seconds * 1000:9.3f} ms", flush=True)


def walk_ladder(example: str) -> int:
    """Plan, apply, and plan again until the true-OOM ladder refuses; returns the rung count."""
    template = load_template(EXAMPLES / example)
    diagnosis = Diagnosis(
        kind=FailureKind.TRUE_OOM,
        confidence=Confidence.HIGH,
        reasons=(),
        onset=Onset.STEP0,
        step=0,
        oom=OomReport(family=OomFamily.TORCH_ALLOCATOR, message="", requested_bytes=2 * GIB),
    )
    revision = initial_revision(template)
    attempts: list[Attempt] = []
    while True:
        result = plan(diagnosis, template, LineageHistory(tuple(attempts)), PlannerPolicy())
        if not isinstance(result, Proposal):
            return len(attempts)
        revision = apply_patch(template, revision, result.patch)
        attempts.append(
            Attempt(
                result.remediation.remediator,
                result.rung,
                FailureKind.TRUE_OOM,
                dict(template.knobs),
                dict(revision.knobs),
                Outcome.SAME_FAILURE,
                0,
                5,
            )
        )
        template = dataclasses.replace(template, knobs=revision.knobs)


def checkpoint_tree(root: Path, half_written: int) -> None:
    good = root / "checkpoint-1"
    good.mkdir(parents=True)
    (good / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    (good / "model.safetensors").write_text("w")
    for step in range(2, half_written + 2):
        directory = root / f"checkpoint-{step}"
        directory.mkdir()
        (directory / "model.safetensors").write_text("w")


HOSTILE = {
    "nested range(100000) loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    ),
    "include": "{% include '/etc/shadow' %}",
    "recursive macro": "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
    "2**100000": "{{ 2**100000 }}",
    "'a'*10**9": "{{ 'a'*10**9 }}",
    "2,001 tags": "{{ name | sh }}" * 2_001,
}


def refuse(template: LaunchTemplate, source: str) -> None:
    try:
        render(dataclasses.replace(template, script_source=source))
    except TemplateError:
        return
    raise RuntimeError("a hostile template rendered")


def main() -> None:
    torchrun = load_template(EXAMPLES / "torchrun")
    for label, body in HOSTILE.items():
        source = torchrun.script_source + body + "\n"
        report(f"refuse {label}", median_s(partial(refuse, torchrun, source), 20))
    for directory in sorted(path for path in EXAMPLES.iterdir() if path.is_dir()):
        template = load_template(directory)
        report(f"render {directory.name}", median_s(partial(render, template), 200))
        first = initial_revision(template)
        knob = "env"
        env = dict(first.knobs[knob])  # type: ignore[arg-type]
        env["BENCH"] = "1"
        patch = Patch((KnobChange(knob, first.knobs[knob], tuple(sorted(env.items()))),), "b")
        report(
            f"apply_patch (validate + render + diff) {directory.name}",
            median_s(partial(apply_patch, template, first, patch), 200),
        )
    for example in ("megatron", "hf-trainer"):
        rungs = walk_ladder(example)
        seconds = median_s(partial(walk_ladder, example), 20)
        report(f"true-OOM ladder walk {example} ({rungs} plans + patches)", seconds)
    for script, dialect in (
        ("hf_run_clm.sbatch", "hf"),
        ("megatron_gpt.sbatch", "megatron"),
        ("deepspeed_zero.sbatch", "deepspeed"),
        ("torchrun_env.sbatch", "torchrun"),
    ):
        text = (DATA / script).read_text()
        document = {"name": "b", "dialect": dialect, "script": "job.sbatch", "imported": True}
        seconds = median_s(partial(parse_template, document, text), 100)
        report(f"load imported {script} (analysed)", seconds)
        template = parse_template(document, text)
        micro = template.dialect.roles[Role.MICRO_BATCH]
        if micro in template.not_managed:
            continue
        value = template.knobs[micro]
        moved = {**template.knobs, micro: value + 1 if isinstance(value, int) else value}
        seconds = median_s(partial(render, template, moved), 100)
        report(f"render imported {script}, micro moved, read back", seconds)
    for count in (1_000, 10_000):
        with tempfile.TemporaryDirectory() as temporary:
            root = Path(temporary)
            checkpoint_tree(root, count)
            spec = CheckpointSpec(CheckpointLayout.HF, str(root))
            found = find_last_good(spec)
            if found.found is None or len(found.skipped) != count:
                raise RuntimeError(f"checkpoint scan found {found}")
            report(
                f"checkpoint scan, {count} half-written above the good one",
                median_s(partial(find_last_good, spec), 5),
            )


if __name__ == "__main__":
    main()
