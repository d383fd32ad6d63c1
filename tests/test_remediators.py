"""Each lever on its own: when it applies, what it patches, and the words it proposes with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, MidRunCause, Onset
from daemon.dialects.base import KnobValue, Role
from daemon.evidence.records import OomFamily, OomReport, Phase
from daemon.slurm.records import MEDIC_REASON_PREFIX
from daemon.templates.model import LaunchTemplate, validate_knobs
from daemon.templates.reading import load_template
from daemon.templates.rendering import render
from daemon.templates.revisions import Patch
from remediators.allocator import (
    ExpandableSegments,
    GarbageCollectionThreshold,
    MaxSplitSize,
    max_split_mb,
    set_alloc_option,
)
from remediators.base import NodeActionKind, NotApplicable
from remediators.eval_batch import EvalAccumulation, EvalBatchDown, GenerationCap
from remediators.micro_batch import MicroBatchDown
from remediators.nodes import DrainAndExclude, ExcludeNode
from remediators.recompute import FullRecompute, SelectiveRecompute
from remediators.registry import BY_NAME, REMEDIATORS
from remediators.sequence import SequenceLengthDown
from remediators.sharding import EightBitOptimizer, ShardingUp
from remediators.workers import WorkersDown

EXAMPLES = Path(__file__).resolve().parent.parent / "launch_templates"
GIB = 1024**3
MIB = 1024**2


def example(name: str, **knobs: object) -> LaunchTemplate:
    template = load_template(EXAMPLES / name)
    return dataclasses.replace(
        template, knobs=validate_knobs(template.dialect, {**template.knobs, **knobs})
    )


def diagnosis(kind: FailureKind, **fields: object) -> Diagnosis:
    values: dict[str, object] = {
        "kind": kind,
        "confidence": Confidence.HIGH,
        "reasons": ("test",),
        "onset": Onset.STEP0,
        "step": 0,
        "oom": OomReport(
            family=OomFamily.TORCH_ALLOCATOR,
            message="CUDA out of memory",
            requested_bytes=1536 * MIB,
            total_bytes=80 * GIB,
            free_bytes=900 * MIB,
            reserved_bytes=75 * GIB,
            reserved_unallocated_bytes=9 * GIB,
        ),
    }
    values.update(fields)
    return Diagnosis(**values)  # type: ignore[arg-type]


def knobs_after(
    template: LaunchTemplate, remediator_name: str, diag: Diagnosis
) -> dict[str, KnobValue]:
    proposal = BY_NAME[remediator_name].propose(diag, template)
    return Patch(proposal.changes, "test").apply(template.dialect, template.knobs)


def env_of(knobs: dict[str, KnobValue]) -> dict[str, str]:
    env = knobs["env"]
    assert isinstance(env, tuple)
    return {str(pair[0]): str(pair[1]) for pair in env if isinstance(pair, tuple)}


def test_the_registry_lists_every_lever_once() -> None:
    names = [remediator.name for remediator in REMEDIATORS]
    assert len(names) == len(set(names)) == len(BY_NAME)
    assert {remediator.lever.value for remediator in REMEDIATORS} >= {
        "allocator",
        "batch",
        "recompute",
        "sharding",
        "eval",
        "workers",
        "sequence",
        "placement",
    }


def test_alloc_conf_merge_keeps_other_options_and_their_order() -> None:
    conf = "pinned_use_cuda_host_register:True, max_split_size_mb:128,roundup_power2_divisions:4"
    assert set_alloc_option(conf, "expandable_segments", "True") == (
        "pinned_use_cuda_host_register:True,max_split_size_mb:128,"
        "roundup_power2_divisions:4,expandable_segments:True"
    )
    assert set_alloc_option(conf, "max_split_size_mb", "512") == (
        "pinned_use_cuda_host_register:True,max_split_size_mb:512,roundup_power2_divisions:4"
    )
    assert set_alloc_option("", "expandable_segments", "True") == "expandable_segments:True"


def test_expandable_segments_merges_into_the_variable_the_job_already_sets() -> None:
    frag = diagnosis(FailureKind.FRAGMENTATION)
    hf = example("hf-trainer")  # sets PYTORCH_CUDA_ALLOC_CONF
    env = env_of(knobs_after(hf, "allocator_expandable_segments", frag))
    assert env == {
        "PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,expandable_segments:True"
    }
    torchrun = example("torchrun")  # sets PYTORCH_ALLOC_CONF=expandable_segments:False
    env = env_of(knobs_after(torchrun, "allocator_expandable_segments", frag))
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    both = example(
        "hf-trainer", env={"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}
    )
    env = env_of(knobs_after(both, "allocator_expandable_segments", frag))
    assert env == {
        "PYTORCH_ALLOC_CONF": "a:1,expandable_segments:True",
        "PYTORCH_CUDA_ALLOC_CONF": "b:2,expandable_segments:True",
    }
    bare = example("deepspeed", env={"OMP_NUM_THREADS": "8"})
    env = env_of(knobs_after(bare, "allocator_expandable_segments", frag))
    assert env == {"OMP_NUM_THREADS": "8", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_allocator_levers_refuse_where_they_cannot_work() -> None:
    frag = diagnosis(FailureKind.FRAGMENTATION)
    already = example("hf-trainer", env={"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert (
        ExpandableSegments().applies(frag, already).reason
        == "expandable_segments:True is already set"
    )
    async_backend = example(
        "hf-trainer", env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    )
    for lever in (ExpandableSegments(), MaxSplitSize(), GarbageCollectionThreshold()):
        verdict = lever.applies(frag, async_backend)
        assert not verdict
        assert "cudaMallocAsync" in verdict.reason
        with pytest.raises(NotApplicable):
            lever.propose(frag, async_backend)
    no_numbers = diagnosis(FailureKind.FRAGMENTATION, oom=None)
    assert "no request size" in MaxSplitSize().applies(no_numbers, example("hf-trainer")).reason


def test_max_split_size_is_sized_from_the_largest_failed_request() -> None:
    assert max_split_mb(1536 * MIB) == 1536
    assert max_split_mb(1000 * MIB) == 992
    assert max_split_mb(33 * MIB) == 32
    proposal = MaxSplitSize().propose(diagnosis(FailureKind.FRAGMENTATION), example("megatron"))
    assert "1.50 GiB" in proposal.rationale
    assert "9.00 GiB reserved but unallocated" in proposal.rationale
    env = proposal.changes[0].after
    assert ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1536") in env  # type: ignore[operator]
    assert ("CUDA_DEVICE_MAX_CONNECTIONS", "1") in env  # type: ignore[operator]
    assert not proposal.changes_science


def test_gc_threshold_is_set_once() -> None:
    frag = diagnosis(FailureKind.FRAGMENTATION)
    template = example("torchrun")
    after = knobs_after(template, "allocator_gc_threshold", frag)
    assert (
        env_of(after)["PYTORCH_ALLOC_CONF"]
        == "expandable_segments:False,garbage_collection_threshold:0.6"
    )
    again = dataclasses.replace(template, knobs=after)
    assert not GarbageCollectionThreshold().applies(frag, again)


@pytest.mark.parametrize("name", ["hf-trainer", "deepspeed", "torchrun"])
def test_micro_batch_down_keeps_the_global_batch(name: str) -> None:
    template = example(name)
    before = template.dialect.geometry(template.knobs)
    proposal = MicroBatchDown().propose(diagnosis(FailureKind.TRUE_OOM), template)
    after = template.dialect.geometry(
        Patch(proposal.changes, "t").apply(template.dialect, template.knobs)
    )
    assert (after.micro, after.accum) == (before.micro // 2, before.accum * 2)
    assert after.global_batch == before.global_batch
    assert f"global batch stays {before.global_batch}" in proposal.rationale
    assert proposal.cost.throughput_loss_pct == (5, 15)
    assert not proposal.changes_science


def test_megatron_moves_only_the_micro_batch_under_its_fixed_global_batch() -> None:
    template = example("megatron")
    proposal = MicroBatchDown().propose(diagnosis(FailureKind.TRUE_OOM), template)
    assert [(c.knob, c.before, c.after) for c in proposal.changes] == [("micro_batch_size", 4, 2)]
    assert (
        "accumulation 4 -> 8; global batch stays 64 = 2 x 8 x 4 data-parallel" in proposal.rationale
    )


def test_micro_batch_down_refusals() -> None:
    true_oom = diagnosis(FailureKind.TRUE_OOM)
    assert MicroBatchDown().applies(
        true_oom, example("hf-trainer", per_device_train_batch_size=1)
    ).reason == ("the micro-batch is already 1")
    capped = example("hf-trainer", gradient_accumulation_steps=65536)
    assert "would pass its maximum" in MicroBatchDown().applies(true_oom, capped).reason
    odd = example("hf-trainer", per_device_train_batch_size=3, gradient_accumulation_steps=2)
    changes = MicroBatchDown().propose(true_oom, odd).changes
    assert [(c.knob, c.after) for c in changes] == [
        ("per_device_train_batch_size", 1),
        ("gradient_accumulation_steps", 6),
    ]


def test_mid_run_rationale_names_the_cause() -> None:
    mid = diagnosis(
        FailureKind.TRUE_OOM,
        onset=Onset.MID_RUN,
        step=1200,
        mid_run_cause=MidRunCause.LONGEST_BATCH,
    )
    proposal = MicroBatchDown().propose(mid, example("hf-trainer"))
    assert "mid-run at step 1200, driven by the longest batch so far" in proposal.rationale


def test_recompute_goes_selective_then_full() -> None:
    true_oom = diagnosis(FailureKind.TRUE_OOM)
    megatron = example("megatron")
    selective = knobs_after(megatron, "recompute_selective", true_oom)
    assert selective["recompute_granularity"] == "selective"
    upgraded = dataclasses.replace(megatron, knobs=selective)
    assert not SelectiveRecompute().applies(true_oom, upgraded)
    full = FullRecompute().propose(true_oom, upgraded)
    assert {(c.knob, c.after) for c in full.changes} == {("recompute_granularity", "full")}
    assert full.cost.throughput_loss_pct == (20, 30)
    hf = example("hf-trainer")
    assert "no selective mode" in SelectiveRecompute().applies(true_oom, hf).reason
    assert knobs_after(hf, "recompute_full", true_oom)["gradient_checkpointing"] is True
    custom = example("megatron", recompute_method="block", recompute_num_layers=4)
    changes = {(c.knob, c.after) for c in FullRecompute().propose(true_oom, custom).changes}
    assert changes == {
        ("recompute_granularity", "full"),
        ("recompute_method", "uniform"),
        ("recompute_num_layers", 1),
    }


def test_sharding_steps_up_and_stops_at_the_top() -> None:
    burst = diagnosis(FailureKind.OPTIMIZER_BURST, phase=Phase.OPTIMIZER_STEP)
    deepspeed = example("deepspeed")
    proposal = ShardingUp().propose(burst, deepspeed)
    assert [(c.knob, c.before, c.after) for c in proposal.changes] == [("zero_stage", 1, 2)]
    assert proposal.rationale.startswith("Optimizer burst")
    assert "1/4" in proposal.expected_effect
    assert "highest stage" in ShardingUp().applies(burst, example("deepspeed", zero_stage=3)).reason
    megatron = knobs_after(example("megatron"), "sharding_up", burst)
    assert megatron["use_distributed_optimizer"] is True
    single = example("torchrun", nodes=1, gpus_per_node=1)
    assert "one data-parallel rank" in ShardingUp().applies(burst, single).reason
    assert "no optimizer-sharding knob" in ShardingUp().applies(burst, example("hf-trainer")).reason


def test_eight_bit_optimizer_is_flagged_as_changing_the_science() -> None:
    proposal = EightBitOptimizer().propose(
        diagnosis(FailureKind.OPTIMIZER_BURST), example("hf-trainer")
    )
    assert proposal.changes_science
    assert proposal.changes[0].after == "adamw_8bit"


def test_eval_levers() -> None:
    growth = diagnosis(FailureKind.EVAL_GROWTH, phase=Phase.EVAL, step=500)
    hf = example("hf-trainer")
    assert knobs_after(hf, "eval_batch_down", growth)["per_device_eval_batch_size"] == 8
    assert knobs_after(hf, "eval_accumulation", growth)["eval_accumulation_steps"] == 1
    proposal = EvalBatchDown().propose(growth, hf)
    assert "in eval at step 500" in proposal.rationale
    assert not EvalAccumulation().applies(growth, example("hf-trainer", eval_accumulation_steps=1))
    unset = example("torchrun", eval_batch=0)
    assert "not set in the template" in EvalBatchDown().applies(growth, unset).reason
    assert "no eval batch knob" in EvalBatchDown().applies(growth, example("megatron")).reason


def test_generation_cap_bounds_the_kv_cache_and_says_it_changes_eval() -> None:
    generate = diagnosis(FailureKind.EVAL_GROWTH, phase=Phase.EVAL, step=500)
    assert "not set" in GenerationCap().applies(generate, example("hf-trainer")).reason
    proposal = GenerationCap().propose(generate, example("hf-trainer", generation_max_length=512))
    assert [(c.knob, c.after) for c in proposal.changes] == [("generation_max_length", 256)]
    assert proposal.changes_science
    after = knobs_after(
        example("hf-trainer", generation_max_length=512), "eval_generation_cap", generate
    )
    assert "--generation_max_length 256" in render(example("hf-trainer"), after)


def test_workers_down_halves_and_stops_at_zero_or_unset() -> None:
    host = diagnosis(FailureKind.HOST_RAM, oom=None, node="gpu-02")
    proposal = WorkersDown().propose(host, example("hf-trainer"))
    assert [(c.knob, c.after) for c in proposal.changes] == [("dataloader_num_workers", 2)]
    assert "gpu-02" in proposal.rationale
    assert "4 fewer worker processes per node" in proposal.rationale
    assert not WorkersDown().applies(host, example("hf-trainer", dataloader_num_workers=0))
    assert "not set" in WorkersDown().applies(host, example("torchrun", num_workers=-1)).reason


def test_sequence_length_is_never_a_silent_change() -> None:
    proposal = SequenceLengthDown().propose(
        diagnosis(FailureKind.WORKSPACE_SPIKE), example("megatron")
    )
    assert proposal.changes_science
    assert proposal.changes[0].after == 1024
    assert "bucketing" in proposal.rationale
    assert not SequenceLengthDown().applies(
        diagnosis(FailureKind.TRUE_OOM), example("hf-trainer", max_seq_length=0)
    )


def test_cotenant_is_excluded_not_drained_and_its_pid_reported() -> None:
    cotenant = diagnosis(FailureKind.COTENANT, bad_nodes=("gpu-03",), cotenant_pids=(4242,))
    template = example("hf-trainer", exclude=["gpu-01"])
    proposal = ExcludeNode().propose(cotenant, template)
    assert proposal.changes[0].after == ("gpu-01", "gpu-03")
    assert proposal.actions == ()
    assert "pid 4242" in proposal.rationale
    excluded = dataclasses.replace(
        template, knobs={**template.knobs, "exclude": ("gpu-01", "gpu-03")}
    )
    assert "already excluded" in ExcludeNode().applies(cotenant, excluded).reason


def test_hardware_drains_with_a_medic_reason_and_excludes() -> None:
    hardware = diagnosis(
        FailureKind.HARDWARE,
        bad_nodes=("gpu-02",),
        reasons=("XID 79 on gpu-02\nfallen off the bus",),
        probe_confirmed=True,
    )
    proposal = DrainAndExclude().propose(hardware, example("torchrun"))
    assert proposal.changes[0].after == ("gpu-02",)
    [action] = proposal.actions
    assert action.kind is NodeActionKind.DRAIN
    assert action.node == "gpu-02"
    assert action.reason.startswith(MEDIC_REASON_PREFIX)
    assert "\n" not in action.reason
    assert not DrainAndExclude().applies(
        diagnosis(FailureKind.COTENANT, bad_nodes=("gpu-02",)), example("torchrun")
    )


def test_a_fault_only_the_log_shows_is_excluded_never_drained() -> None:
    # Anyone can print `Xid 79` in their own job's output.
    from_log = diagnosis(FailureKind.HARDWARE, bad_nodes=("gpu-02",), probe_confirmed=False)
    refused = DrainAndExclude().applies(from_log, example("torchrun"))
    assert not refused
    assert "no node probe confirmed" in refused.reason
    assert ExcludeNode().applies(from_log, example("torchrun"))


geometries = st.fixed_dictionaries(
    {
        "nodes": st.integers(1, 64),
        "gpus": st.sampled_from([1, 2, 4, 8]),
        "micro": st.integers(1, 256),
        "accum": st.integers(1, 512),
    }
)


@settings(max_examples=200, deadline=None)
@given(geometry=geometries, name=st.sampled_from(["hf-trainer", "deepspeed", "torchrun"]))
def test_property_micro_batch_down_keeps_global_batch(geometry: dict[str, int], name: str) -> None:
    template = example(name, nodes=geometry["nodes"], gpus_per_node=geometry["gpus"])
    dialect = template.dialect
    knobs = {
        **template.knobs,
        dialect.roles[Role.MICRO_BATCH]: geometry["micro"],
        dialect.roles[Role.GRAD_ACCUM]: geometry["accum"],
    }
    template = dataclasses.replace(template, knobs=validate_knobs(dialect, knobs))
    verdict = MicroBatchDown().applies(diagnosis(FailureKind.TRUE_OOM), template)
    if geometry["micro"] == 1:
        assert verdict.reason == "the micro-batch is already 1"
        return
    if not verdict:
        assert "would pass its maximum 65536" in verdict.reason
        assert geometry["accum"] * 2 > 65536 // geometry["micro"]
        return
    assert verdict, verdict.reason
    after = knobs_after(template, "micro_batch_down", diagnosis(FailureKind.TRUE_OOM))
    before_geometry, after_geometry = dialect.geometry(template.knobs), dialect.geometry(after)
    assert after_geometry.global_batch == before_geometry.global_batch
    assert after_geometry.micro < before_geometry.micro


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.integers(1, 32),
    gpus=st.sampled_from([1, 2, 4, 8]),
    tensor=st.sampled_from([1, 2, 4, 8]),
    pipeline=st.sampled_from([1, 2, 4]),
    micro=st.integers(1, 64),
    accum=st.integers(1, 64),
)
def test_property_megatron_patches_keep_its_fixed_global_batch(
    nodes: int, gpus: int, tensor: int, pipeline: int, micro: int, accum: int
) -> None:
    world = nodes * gpus
    if world % (tensor * pipeline):
        return
    data_parallel = world // (tensor * pipeline)
    template = example(
        "megatron",
        nodes=nodes,
        gpus_per_node=gpus,
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        micro_batch_size=micro,
        global_batch_size=micro * accum * data_parallel,
    )
    true_oom = diagnosis(FailureKind.TRUE_OOM)
    for remediator in REMEDIATORS:
        if not remediator.applies(true_oom, template):
            continue
        after = Patch(remediator.propose(true_oom, template).changes, "t").apply(
            template.dialect, template.knobs
        )
        if remediator.name == "sequence_length_down":
            continue
        assert after["global_batch_size"] == micro * accum * data_parallel
        assert template.dialect.geometry(after).global_batch == micro * accum * data_parallel


@settings(max_examples=150, deadline=None)
@given(
    geometry=geometries,
    name=st.sampled_from(["hf-trainer", "deepspeed", "torchrun", "megatron"]),
    kind=st.sampled_from(
        [kind for kind in FailureKind if kind not in (FailureKind.NOT_OOM, FailureKind.UNKNOWN)]
    ),
)
def test_property_no_lever_that_keeps_the_science_moves_the_global_batch(
    geometry: dict[str, int], name: str, kind: FailureKind
) -> None:
    template = load_template(EXAMPLES / name)
    dialect = template.dialect
    knobs: dict[str, object] = {**template.knobs, "nodes": geometry["nodes"]}
    knobs["gpus_per_node"] = geometry["gpus"]
    knobs[dialect.roles[Role.MICRO_BATCH]] = geometry["micro"]
    if dialect.global_batch_fixed:
        knobs["global_batch_size"] = (
            geometry["micro"] * geometry["accum"] * geometry["nodes"] * geometry["gpus"]
        )
    else:
        knobs[dialect.roles[Role.GRAD_ACCUM]] = geometry["accum"]
    template = dataclasses.replace(template, knobs=validate_knobs(dialect, knobs))
    diag = diagnosis(kind, bad_nodes=("gpu-09",))
    before = dialect.geometry(template.knobs).global_batch
    for remediator in REMEDIATORS:
        if not remediator.applies(diag, template):
            continue
        proposal = remediator.propose(diag, template)
        after = Patch(proposal.changes, "t").apply(dialect, template.knobs)
        if not proposal.changes_science:
            assert dialect.geometry(after).global_batch == before, remediator.name
