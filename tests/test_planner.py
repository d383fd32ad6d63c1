"""The planner: walking a lineage up each kind's ladder, budgets, no progress, hard rules."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from daemon import planner
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, MidRunCause, Onset
from daemon.dialects.base import Role
from daemon.evidence.records import OomFamily, OomReport, Phase
from daemon.planner import (
    Attempt,
    LineageHistory,
    Outcome,
    PlannerPolicy,
    Proposal,
    Refusal,
    attempt_from,
    plan,
    with_outcome,
)
from daemon.templates.model import LaunchTemplate
from daemon.templates.reading import load_template
from daemon.templates.revisions import TemplateRevision, apply_patch, initial_revision
from remediators.base import Lever
from remediators.registry import BY_NAME

EXAMPLES = Path(__file__).resolve().parent.parent / "launch_templates"
GIB = 1024**3


def diagnosis(kind: FailureKind, **fields: object) -> Diagnosis:
    values: dict[str, object] = {
        "kind": kind,
        "confidence": Confidence.HIGH,
        "reasons": ("XID 79 on gpu-03",),
        "onset": Onset.STEP0,
        "step": 0,
        "phase": Phase.FORWARD,
        "bad_nodes": ("gpu-03",),
        "cotenant_pids": (4242,),
        "oom": OomReport(
            family=OomFamily.TORCH_ALLOCATOR,
            message="CUDA out of memory",
            requested_bytes=2 * GIB,
            total_bytes=80 * GIB,
            free_bytes=GIB,
            reserved_bytes=70 * GIB,
            reserved_unallocated_bytes=6 * GIB,
        ),
    }
    values.update(fields)
    return Diagnosis(**values)  # type: ignore[arg-type]


def walk(
    template: LaunchTemplate,
    diag: Diagnosis,
    policy: PlannerPolicy | None = None,
    step_reached: int = 10,
) -> tuple[list[Proposal], Refusal, list[TemplateRevision]]:
    """Relaunch after each proposal; every relaunch fails the same way but gets further."""
    policy = policy or PlannerPolicy(max_attempts_per_lineage=20)
    revision = initial_revision(template)
    current = template
    attempts: list[Attempt] = []
    proposals: list[Proposal] = []
    revisions = [revision]
    while True:
        result = plan(diag, current, LineageHistory(tuple(attempts)), policy)
        if isinstance(result, Refusal):
            return proposals, result, revisions
        proposals.append(result)
        revision = apply_patch(current, revision, result.patch)
        revisions.append(revision)
        attempt = attempt_from(result, current.knobs, failing_step=diag.step)
        attempts.append(with_outcome(attempt, Outcome.SAME_FAILURE, step_reached))
        current = dataclasses.replace(current, knobs=revision.knobs)


def names(proposals: list[Proposal]) -> list[str]:
    return [proposal.remediation.remediator for proposal in proposals]


def example(name: str) -> LaunchTemplate:
    return load_template(EXAMPLES / name)


LADDERS = {
    ("megatron", FailureKind.TRUE_OOM): [
        "micro_batch_down",
        "recompute_selective",
        "recompute_full",
        "sharding_up",
        "sequence_length_down",
    ],
    ("hf-trainer", FailureKind.TRUE_OOM): [
        "micro_batch_down",
        "recompute_full",
        "sequence_length_down",
    ],
    ("deepspeed", FailureKind.TRUE_OOM): ["micro_batch_down", "recompute_full", "sharding_up"],
    ("torchrun", FailureKind.FRAGMENTATION): [
        "allocator_expandable_segments",
        "allocator_max_split_size",
        "allocator_gc_threshold",
    ],
    # The probe did not confirm it (the helper's default): excluded, never drained.
    ("hf-trainer", FailureKind.HARDWARE): ["exclude_node"],
    ("hf-trainer", FailureKind.COTENANT): ["exclude_node"],
    ("deepspeed", FailureKind.HOST_RAM): ["dataloader_workers_down"],
    ("torchrun", FailureKind.WORKSPACE_SPIKE): [
        "recompute_selective",
        "micro_batch_down",
        "sequence_length_down",
    ],
    ("megatron", FailureKind.OPTIMIZER_BURST): ["sharding_up"],
    ("hf-trainer", FailureKind.OPTIMIZER_BURST): ["optimizer_8bit"],
    ("hf-trainer", FailureKind.EVAL_GROWTH): ["eval_batch_down", "eval_accumulation"],
    ("torchrun", FailureKind.EVAL_GROWTH): ["eval_batch_down", "eval_accumulation"],
}


@pytest.mark.parametrize(("name", "kind"), list(LADDERS), ids=str)
def test_walking_a_lineage_up_the_ladder(name: str, kind: FailureKind) -> None:
    proposals, refusal, revisions = walk(example(name), diagnosis(kind))
    assert names(proposals) == LADDERS[(name, kind)]
    assert refusal.reason.startswith(f"the {kind.value} ladder is exhausted: every rung was tried")
    assert refusal.asks_person
    assert [proposal.rung for proposal in proposals] == sorted({p.rung for p in proposals})
    for parent, child in itertools.pairwise(revisions):
        assert child.parent == parent.id
        assert child.diff.startswith("---")
        assert child.knobs != parent.knobs


def test_fragmentation_never_cuts_the_batch_and_true_oom_never_touches_the_allocator() -> None:
    for name in ("hf-trainer", "megatron", "deepspeed", "torchrun"):
        template = example(name)
        micro_knob = template.dialect.roles[Role.MICRO_BATCH]
        proposals, _, revisions = walk(template, diagnosis(FailureKind.FRAGMENTATION))
        assert {p.remediation.lever for p in proposals} == {Lever.ALLOCATOR}
        assert all(r.knobs[micro_knob] == template.knobs[micro_knob] for r in revisions)
        proposals, _, revisions = walk(template, diagnosis(FailureKind.TRUE_OOM))
        assert Lever.ALLOCATOR not in {p.remediation.lever for p in proposals}
        assert all(r.knobs["env"] == template.knobs["env"] for r in revisions)


def test_hard_rules_hold_even_against_a_wrong_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = {
        **planner.LADDERS,
        FailureKind.TRUE_OOM: ("allocator_expandable_segments", "micro_batch_down"),
        FailureKind.FRAGMENTATION: ("micro_batch_down", "allocator_expandable_segments"),
    }
    monkeypatch.setattr(planner, "LADDERS", wrong)
    result = plan(
        diagnosis(FailureKind.TRUE_OOM), example("hf-trainer"), LineageHistory(), PlannerPolicy()
    )
    assert isinstance(result, Proposal)
    assert result.remediation.remediator == "micro_batch_down"
    assert result.skipped[0].reason == "never a allocator change on true_oom"
    result = plan(
        diagnosis(FailureKind.FRAGMENTATION),
        example("hf-trainer"),
        LineageHistory(),
        PlannerPolicy(),
    )
    assert isinstance(result, Proposal)
    assert result.remediation.remediator == "allocator_expandable_segments"
    assert result.skipped[0].reason == "never a batch change on fragmentation"


def test_not_oom_and_unknown_propose_nothing() -> None:
    for kind in (FailureKind.NOT_OOM, FailureKind.UNKNOWN):
        result = plan(diagnosis(kind), example("hf-trainer"), LineageHistory(), PlannerPolicy())
        assert isinstance(result, Refusal)
        assert "not a memory failure" in result.reason


def _attempt(
    name: str, rung: int, outcome: Outcome, reached: int | None, template: LaunchTemplate
) -> Attempt:
    return Attempt(
        remediator=name,
        rung=rung,
        kind=FailureKind.TRUE_OOM,
        knobs_before=dict(template.knobs),
        knobs_after=dict(template.knobs),
        outcome=outcome,
        failing_step=100,
        step_reached=reached,
    )


def test_no_progress_moves_up_a_rung_and_twice_ends_retries() -> None:
    megatron = example("megatron")
    mid = diagnosis(
        FailureKind.TRUE_OOM, onset=Onset.MID_RUN, step=100, mid_run_cause=MidRunCause.GROWTH
    )
    policy = PlannerPolicy(per_rule={"micro_batch_down": 3})
    stalled = _attempt("micro_batch_down", 0, Outcome.SAME_FAILURE, 100, megatron)
    smaller = dataclasses.replace(megatron, knobs={**megatron.knobs, "micro_batch_size": 2})
    result = plan(mid, smaller, LineageHistory((stalled,)), policy)
    assert isinstance(result, Proposal)
    assert result.remediation.remediator == "recompute_selective"
    assert result.skipped[0].reason == "below the rung that made no progress last time"
    progressed = _attempt("micro_batch_down", 0, Outcome.SAME_FAILURE, 140, megatron)
    result = plan(mid, smaller, LineageHistory((progressed,)), policy)
    assert isinstance(result, Proposal)
    assert (
        result.remediation.remediator == "micro_batch_down"
    )  # per-rule budget 3 allows a second cut
    twice = (stalled, _attempt("recompute_selective", 1, Outcome.SAME_FAILURE, 90, megatron))
    result = plan(mid, smaller, LineageHistory(twice), policy)
    assert isinstance(result, Refusal)
    assert "2 relaunches in a row did not get past the failing step" in result.reason


def test_budgets_and_different_failures_stop_the_lineage() -> None:
    hf = example("hf-trainer")
    true_oom = diagnosis(FailureKind.TRUE_OOM)
    done = tuple(_attempt("micro_batch_down", 0, Outcome.SAME_FAILURE, 500, hf) for _ in range(3))
    result = plan(true_oom, hf, LineageHistory(done), PlannerPolicy(max_attempts_per_lineage=3))
    assert isinstance(result, Refusal)
    assert result.reason == "the lineage used its budget of 3 attempts"
    different = (_attempt("micro_batch_down", 0, Outcome.DIFFERENT_FAILURE, 500, hf),)
    result = plan(true_oom, hf, LineageHistory(different), PlannerPolicy())
    assert isinstance(result, Refusal)
    assert "failed differently" in result.reason
    once = (_attempt("micro_batch_down", 0, Outcome.SAME_FAILURE, 500, hf),)
    result = plan(true_oom, hf, LineageHistory(once), PlannerPolicy())
    assert isinstance(result, Proposal)
    assert result.skipped[0].reason == "already tried 1 time(s) in this lineage (budget 1)"


def test_never_back_into_a_config_that_already_died() -> None:
    hf = example("hf-trainer")
    halved = {**hf.knobs, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 16}
    died = Attempt(
        remediator="recompute_full",
        rung=1,
        kind=FailureKind.TRUE_OOM,
        knobs_before=halved,
        knobs_after=halved,
        outcome=Outcome.SAME_FAILURE,
        failing_step=0,
        step_reached=3,
    )
    result = plan(diagnosis(FailureKind.TRUE_OOM), hf, LineageHistory((died,)), PlannerPolicy())
    assert isinstance(result, Proposal)
    assert result.skipped[0].reason == "it leads back to a config that already died in this lineage"
    assert result.knobs_after != halved


def test_optimizer_state_mid_run_shards_before_cutting_the_batch() -> None:
    mid = diagnosis(
        FailureKind.TRUE_OOM, onset=Onset.MID_RUN, step=2, mid_run_cause=MidRunCause.OPTIMIZER_STATE
    )
    result = plan(mid, example("megatron"), LineageHistory(), PlannerPolicy())
    assert isinstance(result, Proposal)
    assert result.remediation.remediator == "sharding_up"
    assert "optimizer state allocated after the first steps" in result.remediation.rationale


def test_science_changing_proposals_require_a_person() -> None:
    proposals, _, _ = walk(example("megatron"), diagnosis(FailureKind.TRUE_OOM))
    assert [p.requires_person for p in proposals] == [False, False, False, False, True]
    assert proposals[-1].remediation.remediator == "sequence_length_down"


def test_every_ladder_names_registered_remediators() -> None:
    for ladder in planner.LADDERS.values():
        assert set(ladder) <= set(BY_NAME)


def test_a_lever_the_template_never_renders_is_skipped() -> None:
    hf = example("hf-trainer")
    blind = dataclasses.replace(
        hf, script_source="#!/bin/bash\n{{ sbatch_header }}\n{{ env_exports }}\nsrun train.py\n"
    )
    result = plan(diagnosis(FailureKind.TRUE_OOM), blind, LineageHistory(), PlannerPolicy())
    assert isinstance(result, Refusal)
    assert {(s.remediator, s.reason) for s in result.skipped} == {
        ("micro_batch_down", "its change would not reach the rendered script"),
        (
            "recompute_selective",
            "gradient_checkpointing has no selective mode (only full recompute)",
        ),
        ("recompute_full", "its change would not reach the rendered script"),
        ("sharding_up", "dialect hf has no optimizer-sharding knob"),
        ("sequence_length_down", "its change would not reach the rendered script"),
    }


def test_a_hardware_fault_the_probe_confirmed_drains_the_node() -> None:
    proposals, _refusal, _revisions = walk(
        example("hf-trainer"), diagnosis(FailureKind.HARDWARE, probe_confirmed=True)
    )
    # exclude_node is then skipped: the drain's relaunch already excludes gpu-03.
    assert names(proposals) == ["drain_and_exclude"]
