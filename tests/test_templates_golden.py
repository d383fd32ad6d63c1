"""Golden scripts: every dialect's example rendered before and after each lever that applies.

The goldens under tests/golden/<example>/ are reviewed files. Regenerate them with
`SLURM_MEDIC_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_templates_golden.py`, then read the
diff before committing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon import process
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.evidence.records import OomFamily, OomReport, Phase
from daemon.templates.reading import load_template
from daemon.templates.revisions import Patch, apply_patch, initial_revision
from remediators.registry import REMEDIATORS

ROOT = Path(__file__).resolve().parent
EXAMPLES = ROOT.parent / "launch_templates"
GOLDEN = ROOT / "golden"
UPDATE = os.environ.get("SLURM_MEDIC_UPDATE_GOLDEN") == "1"
GIB = 1024**3

KIND_FOR = {
    "allocator_expandable_segments": FailureKind.FRAGMENTATION,
    "allocator_max_split_size": FailureKind.FRAGMENTATION,
    "allocator_gc_threshold": FailureKind.FRAGMENTATION,
    "micro_batch_down": FailureKind.TRUE_OOM,
    "recompute_selective": FailureKind.TRUE_OOM,
    "recompute_full": FailureKind.TRUE_OOM,
    "sharding_up": FailureKind.OPTIMIZER_BURST,
    "optimizer_8bit": FailureKind.OPTIMIZER_BURST,
    "eval_batch_down": FailureKind.EVAL_GROWTH,
    "eval_accumulation": FailureKind.EVAL_GROWTH,
    "eval_generation_cap": FailureKind.EVAL_GROWTH,
    "dataloader_workers_down": FailureKind.HOST_RAM,
    "sequence_length_down": FailureKind.WORKSPACE_SPIKE,
    "exclude_node": FailureKind.COTENANT,
    "drain_and_exclude": FailureKind.HARDWARE,
}
EXAMPLE_NAMES = sorted(path.parent.name for path in EXAMPLES.glob("*/template.toml"))


def diagnosis_for(remediator: str) -> Diagnosis:
    return Diagnosis(
        kind=KIND_FOR[remediator],
        confidence=Confidence.HIGH,
        reasons=("XID 79 (GPU has fallen off the bus) on gpu-03",),
        onset=Onset.STEP0,
        step=0,
        phase=Phase.FORWARD,
        bad_nodes=("gpu-03",),
        probe_confirmed=True,  # the probe saw the XID: drain_and_exclude applies
        cotenant_pids=(31337,),
        oom=OomReport(
            family=OomFamily.TORCH_ALLOCATOR,
            message="CUDA out of memory",
            requested_bytes=2 * GIB,
            total_bytes=80 * GIB,
            free_bytes=GIB,
            reserved_bytes=70 * GIB,
            reserved_unallocated_bytes=6 * GIB,
        ),
    )


def renderings(example: str) -> dict[str, str]:
    """base.sbatch and one <remediator>.sbatch per lever that applies to this example."""
    template = load_template(EXAMPLES / example)
    base = initial_revision(template)
    files = {"base.sbatch": base.script}
    for remediator in REMEDIATORS:
        diagnosis = diagnosis_for(remediator.name)
        if not remediator.applies(diagnosis, template):
            continue
        proposal = remediator.propose(diagnosis, template)
        child = apply_patch(template, base, Patch(proposal.changes, proposal.rationale))
        files[f"{remediator.name}.sbatch"] = child.script
    return files


def test_every_lever_has_a_diagnosis_kind() -> None:
    assert set(KIND_FOR) == {remediator.name for remediator in REMEDIATORS}


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_rendered_scripts_match_the_reviewed_goldens(example: str) -> None:
    files = renderings(example)
    directory = GOLDEN / example
    if UPDATE:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.sbatch"):
            stale.unlink()
        for name, script in files.items():
            (directory / name).write_text(script)
    assert sorted(path.name for path in directory.glob("*.sbatch")) == sorted(files)
    for name, script in files.items():
        assert (directory / name).read_text() == script, f"{example}/{name} differs from its golden"
        result = process.run(["bash", "-n"], input_text=script, timeout=10)
        assert result.ok, result.stderr
