"""Acting: the lever must be in the script that is submitted; the resume patch is added on top."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daemon.actions import LeverMissing, build_relaunch, lever_problems
from daemon.checkpoints import Checkpoint, CheckpointLayout
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.planner import LineageHistory, PlannerPolicy, Proposal, plan, planned_fix
from daemon.templates.model import LaunchTemplate
from daemon.templates.reading import load_template
from daemon.templates.rendering import render
from daemon.templates.revisions import initial_revision

ROOT = Path(__file__).resolve().parent.parent
FRAGMENTATION = Diagnosis(FailureKind.FRAGMENTATION, Confidence.HIGH, ("test",), step=4)
CHECKPOINT = Checkpoint(CheckpointLayout.DCP, Path("/ckpt/step_2"), 2, "/ckpt/step_2")


def torchrun(script_tail: str = "") -> LaunchTemplate:
    template = load_template(ROOT / "launch_templates" / "torchrun")
    return dataclasses.replace(template, script_source=template.script_source + script_tail)


def proposal_for(template: LaunchTemplate) -> Proposal:
    outcome = plan(FRAGMENTATION, template, LineageHistory(), PlannerPolicy())
    assert isinstance(outcome, Proposal)
    return outcome


def test_the_allocator_export_is_found_in_the_rendered_script() -> None:
    template = torchrun()
    proposal = proposal_for(template)
    after = proposal.knobs_after
    assert lever_problems(template, template.knobs, after, render(template, after)) == []


def test_an_export_overridden_later_in_the_script_is_caught() -> None:
    template = torchrun("export PYTORCH_ALLOC_CONF=expandable_segments:False\n")
    after = proposal_for(template).knobs_after
    problems = lever_problems(template, template.knobs, after, render(template, after))
    assert problems == [
        "PYTORCH_ALLOC_CONF is set again after the export: "
        "'export PYTORCH_ALLOC_CONF=expandable_segments:False'"
    ]


def test_a_missing_export_is_caught() -> None:
    template = torchrun()
    after = proposal_for(template).knobs_after
    script = render(template, after).replace("expandable_segments:True", "")
    assert any(
        "is not in the rendered script" in p
        for p in lever_problems(template, template.knobs, after, script)
    )


def test_relaunch_carries_the_fix_and_resumes_from_the_checkpoint() -> None:
    template = torchrun()
    proposal = proposal_for(template)
    parent = initial_revision(template)
    fix = planned_fix(proposal, template.knobs, 4)
    relaunch = build_relaunch(template, parent, fix, lambda _t: (CHECKPOINT, ""))
    script = relaunch.revision.script
    assert "export PYTORCH_ALLOC_CONF=expandable_segments:True" in script
    assert "export RESUME_FROM=/ckpt/step_2" in script
    assert relaunch.checkpoint == CHECKPOINT
    assert "expandable_segments:False" not in script


def test_without_a_checkpoint_the_relaunch_starts_over_and_says_so() -> None:
    template = torchrun()
    parent = initial_revision(template)
    fix = planned_fix(proposal_for(template), template.knobs, 4)
    relaunch = build_relaunch(template, parent, fix, lambda _t: (None, "no checkpoint yet"))
    assert "RESUME_FROM" not in relaunch.revision.script
    assert relaunch.checkpoint_note == "no checkpoint yet"


def test_an_overridden_lever_is_never_submitted() -> None:
    template = torchrun("export PYTORCH_ALLOC_CONF=expandable_segments:False\n")
    parent = initial_revision(template)
    fix = planned_fix(proposal_for(template), template.knobs, 4)
    with pytest.raises(LeverMissing, match="set again after the export"):
        build_relaunch(template, parent, fix, lambda _t: (CHECKPOINT, ""))
