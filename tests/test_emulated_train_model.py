"""The emulated run's memory model: formulas, each scenario's death, and each runbook fix."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from emulation.model import (
    GIB,
    NON_PYTORCH_BYTES,
    AllocatorConf,
    AllocKind,
    Card,
    ModelShape,
    Phase,
    Recompute,
    TrainConfig,
    activation_bytes,
    adam_update_temp_bytes,
    layer_attention_bytes,
    layer_input_bytes,
    layer_linear_bytes,
    logits_bytes,
    parse_allocator_conf,
    resident_bytes,
    simulate,
    tail_bytes,
)
from emulation.runner import Failure, find_failure
from emulation.settings import SCENARIOS, Settings, apply_scenario
from emulation.topology import NodeFixture, Placement
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPE_1B3 = ModelShape(
    num_layers=24, hidden_size=2048, num_heads=16, vocab_size=50304, seq_length=2048
)
PARAMS_1B3 = 12 * 24 * 2048**2 + 50304 * 2048
FOUR_NODES = Placement(
    rank=0,
    world_size=4,
    local_rank=0,
    node="gpu-01",
    nodes=("gpu-01", "gpu-02", "gpu-03", "gpu-04"),
)


def config_1b3(**changes: Any) -> TrainConfig:
    base = TrainConfig(shape=SHAPE_1B3, micro_batch=1, grad_accum=1, world_size=4)
    return replace(base, **changes)


def failure_of(
    settings_: Settings, fixtures: dict[str, NodeFixture] | None = None
) -> Failure | None:
    config = settings_.train_config(FOUR_NODES.world_size)
    return find_failure(config, settings_, FOUR_NODES, fixtures or {}, 0)


def scenario(name: str, **changes: Any) -> Settings:
    return replace(apply_scenario(Settings(), name), **changes)


def test_parameter_count_and_eighteen_bytes_per_parameter() -> None:
    assert SHAPE_1B3.params == PARAMS_1B3 == 1_310_982_144
    assert resident_bytes(config_1b3(), with_moments=True) == 18 * PARAMS_1B3
    assert resident_bytes(config_1b3(), with_moments=False) == 10 * PARAMS_1B3


@pytest.mark.parametrize(
    ("changes", "bytes_per_param_times_4"),
    [
        ({"zero_stage": 1}, 4 * (2 + 4) + 12),  # optimizer's 12 bytes shared by 4 ranks
        ({"zero_stage": 2}, 4 * 2 + 4 + 12),
        ({"zero_stage": 3}, 2 + 4 + 12),
        ({"offload_optimizer": True}, 4 * (2 + 4)),
    ],
)
def test_sharding_divides_the_right_shares(
    changes: dict[str, Any], bytes_per_param_times_4: int
) -> None:
    # PARAMS_1B3 is a multiple of 4, so no rounding up hides in the comparison.
    assert resident_bytes(config_1b3(**changes), with_moments=True) * 4 == (
        bytes_per_param_times_4 * PARAMS_1B3
    )


def test_activation_formulas_and_recompute() -> None:
    config = config_1b3()
    assert layer_linear_bytes(config, 2048) == 2048 * 2048 * 34 == 142_606_336
    assert layer_attention_bytes(config, 2048) == 5 * 16 * 2048 * 2048 == 335_544_320
    assert layer_input_bytes(config, 2048) == 2 * 2048 * 2048
    assert logits_bytes(config, 2048) == 2048 * 50304 * 4
    logits = logits_bytes(config, 2048)
    per_layer = 142_606_336 + 335_544_320
    assert activation_bytes(config) == 24 * per_layer + logits
    selective = config_1b3(recompute=Recompute.SELECTIVE)
    assert activation_bytes(selective) == 24 * 142_606_336 + logits
    full = config_1b3(recompute=Recompute.FULL)
    assert activation_bytes(full) == 24 * 2 * 2048 * 2048 + logits
    eight_of_24 = config_1b3(recompute=Recompute.FULL, recompute_num_layers=8)
    assert activation_bytes(eight_of_24) == 8 * 2 * 2048 * 2048 + 16 * per_layer + logits
    assert activation_bytes(config_1b3(micro_batch=2)) == 2 * activation_bytes(config)
    assert activation_bytes(config_1b3(tensor_parallel=2)) < activation_bytes(config)


def test_allocator_conf_parsing_and_tail() -> None:
    conf, ignored = parse_allocator_conf("expandable_segments:True,roundup_power2_divisions:4")
    assert conf == AllocatorConf(expandable_segments=True)
    assert ignored == ["roundup_power2_divisions"]
    assert conf.tail_share() == 0.0
    split, _ = parse_allocator_conf("max_split_size_mb:512")
    assert split.tail_share() == 0.25
    gc, _ = parse_allocator_conf("garbage_collection_threshold:0.6, max_split_size_mb:1024")
    assert gc == AllocatorConf(False, 1024, 0.6)
    assert gc.tail_share() == pytest.approx(0.45)
    for bad in (
        "expandable_segments:yes",
        "max_split_size_mb:ten",
        "max_split_size_mb:8",
        "garbage_collection_threshold:1.5",
        "expandable_segments",
    ):
        with pytest.raises(ValueError, match=r"expandable_segments|max_split|garbage|key:value"):
            parse_allocator_conf(bad)


def test_tail_grows_over_the_first_steps_of_a_process() -> None:
    config = config_1b3(micro_batch=4, fragmentation=0.3)
    acts = activation_bytes(config)
    assert tail_bytes(config, 1) == int(acts * 0.003)
    assert tail_bytes(config, 2) == int(acts * (0.003 + 0.1))
    assert tail_bytes(config, 4) == tail_bytes(config, 9) == int(acts * (0.003 + 0.3))
    expandable = replace(config, allocator=AllocatorConf(expandable_segments=True))
    assert tail_bytes(expandable, 9) == int(acts * 0.003)


def test_card_capacity_matches_pytorch_report_for_80_gib() -> None:
    assert f"{Card().total_bytes / GIB:.2f}" == "79.19"
    assert Card(lost_bytes=GIB).total_bytes == Card().total_bytes - GIB


def test_fragmentation_dies_mid_run_with_a_large_unallocated_reserve() -> None:
    failure = failure_of(scenario("fragmentation"))
    assert failure is not None
    assert failure.oom is not None
    oom = failure.oom
    assert (failure.rank, oom.step, oom.phase, oom.kind) == (3, 4, Phase.FORWARD, AllocKind.LOGITS)
    config = scenario("fragmentation").train_config(4)
    assert oom.requested == logits_bytes(config, 2048) == 1_648_361_472
    assert oom.reserved_unallocated == tail_bytes(config, 4)
    assert oom.reserved_unallocated > 8 * oom.requested
    assert oom.free < oom.requested


@pytest.mark.parametrize(
    "allocator",
    [AllocatorConf(expandable_segments=True), AllocatorConf(max_split_size_mb=512)],
)
def test_fragmentation_fixed_by_allocator_settings(allocator: AllocatorConf) -> None:
    assert failure_of(scenario("fragmentation", allocator=allocator)) is None


def test_gc_threshold_alone_only_shrinks_the_fragmentation_tail() -> None:
    plain = failure_of(scenario("fragmentation"))
    with_gc = failure_of(
        scenario("fragmentation", allocator=AllocatorConf(garbage_collection_threshold=0.6))
    )
    assert plain is not None
    assert plain.oom is not None
    assert with_gc is not None
    assert with_gc.oom is not None
    assert with_gc.oom.reserved_unallocated < plain.oom.reserved_unallocated


def test_true_oom_at_step_one_has_a_small_reserve_and_micro_batch_halving_fixes_it() -> None:
    failure = failure_of(scenario("true-oom-step0"))
    assert failure is not None
    assert failure.oom is not None
    oom = failure.oom
    assert (oom.step, oom.phase, oom.kind) == (1, Phase.FORWARD, AllocKind.LOGITS)
    assert oom.requested == 2048 * 6 * 65536 * 4 == 3 * GIB
    assert oom.reserved_unallocated < oom.requested / 10
    # Capacity, by the runbooks' rule: even free plus reserved-but-unallocated is short.
    free = oom.total - oom.allocated - oom.reserved_unallocated - oom.non_pytorch - oom.cotenant
    assert free + oom.reserved_unallocated < oom.requested
    halved = scenario("true-oom-step0", micro_batch=3, grad_accum=8)
    assert (
        halved.train_config(4).global_batch
        == scenario("true-oom-step0").train_config(4).global_batch
    )
    assert failure_of(halved) is None
    assert failure_of(scenario("true-oom-step0", recompute=Recompute.SELECTIVE)) is None


def test_longest_batch_kills_at_its_step_and_halving_fixes_it() -> None:
    failure = failure_of(scenario("true-oom-midrun"))
    assert failure is not None
    assert failure.oom is not None
    oom = failure.oom
    assert (oom.step, oom.phase) == (7, Phase.FORWARD)
    # It is capacity, not fragmentation: less is unallocated than was asked, and the request
    # would not fit even if every unallocated byte were reused.
    assert oom.reserved_unallocated < oom.requested
    assert oom.allocated + oom.requested + oom.non_pytorch > oom.total
    assert failure_of(scenario("true-oom-midrun", longest_batch_step=None)) is None
    assert failure_of(scenario("true-oom-midrun", micro_batch=2, grad_accum=8)) is None


def test_optimizer_burst_at_step_two_fixed_by_sharding_the_optimizer() -> None:
    settings_ = scenario("optimizer-burst")
    config = settings_.train_config(4)
    failure = failure_of(settings_)
    assert failure is not None
    assert failure.oom is not None
    oom = failure.oom
    assert (oom.step, oom.phase, oom.kind) == (2, Phase.OPTIMIZER, AllocKind.ADAM_UPDATE)
    assert oom.requested == adam_update_temp_bytes(config) == 4 * config.shape.params
    # Adam's moments are on the card from the first optimizer.step on.
    assert oom.allocated == resident_bytes(config, with_moments=True) + oom.requested
    assert failure_of(scenario("optimizer-burst", zero_stage=1)) is None
    # A resumed run loads the moments at start and dies at its first update.
    resumed = simulate(config, Card(), start_step=4).oom
    assert resumed is not None
    assert (resumed.step, resumed.phase) == (5, Phase.OPTIMIZER)


def test_eval_growth_dies_in_eval_and_either_eval_fix_works() -> None:
    failure = failure_of(scenario("eval-growth"))
    assert failure is not None
    assert failure.oom is not None
    assert (failure.oom.step, failure.oom.phase) == (4, Phase.EVAL)
    assert failure_of(scenario("eval-growth", eval_every=None)) is None
    assert failure_of(scenario("eval-growth", eval_batch=16)) is None
    assert failure_of(scenario("eval-growth", eval_accumulation_steps=1)) is None


def test_faulty_and_cotenant_nodes_kill_their_own_rank_only() -> None:
    assert failure_of(scenario("faulty-node")) is None
    sick = {"gpu-03": NodeFixture(xid=79, card_bytes_lost=24 * GIB)}
    failure = failure_of(scenario("faulty-node"), sick)
    assert failure is not None
    assert failure.oom is not None
    assert failure.rank == 2
    assert failure.oom.total == Card().total_bytes - 24 * GIB

    shared = {"gpu-02": NodeFixture(cotenant_bytes=30 * GIB, cotenant_pid=4242)}
    failure = failure_of(scenario("cotenant"), shared)
    assert failure is not None
    assert failure.oom is not None
    assert (failure.rank, failure.cotenant_pid, failure.oom.cotenant) == (1, 4242, 30 * GIB)


def test_host_ram_kills_the_last_rank_and_fewer_workers_fix_it() -> None:
    failure = failure_of(scenario("host-ram"))
    assert failure == Failure(rank=3, step=1, oom=None, cotenant_pid=None)
    assert failure_of(scenario("host-ram", dataloader_workers=8)) is None
    assert failure_of(scenario("host-ram", oom_rank=0)) == Failure(0, 1, None, None)


def test_every_scenario_is_covered_above() -> None:
    assert set(SCENARIOS) == {
        "fragmentation",
        "true-oom-step0",
        "true-oom-midrun",
        "optimizer-burst",
        "eval-growth",
        "faulty-node",
        "cotenant",
        "host-ram",
    }


@settings(max_examples=60, deadline=None)
@given(
    micro_batch=st.integers(1, 16),
    seq=st.sampled_from([512, 1024, 2048, 4096]),
    layers=st.integers(4, 32),
    fragmentation=st.floats(0.0, 0.5),
    lost_gib=st.integers(0, 40),
    cotenant_gib=st.integers(0, 30),
    zero_stage=st.integers(0, 3),
)
def test_oom_numbers_are_always_consistent(
    micro_batch: int,
    seq: int,
    layers: int,
    fragmentation: float,
    lost_gib: int,
    cotenant_gib: int,
    zero_stage: int,
) -> None:
    shape = ModelShape(layers, 2048, 16, 50304, seq)
    config = TrainConfig(
        shape=shape,
        micro_batch=micro_batch,
        grad_accum=1,
        world_size=4,
        zero_stage=zero_stage,
        fragmentation=fragmentation,
        max_steps=6,
    )
    card = Card(lost_bytes=lost_gib * GIB, cotenant_bytes=cotenant_gib * GIB)
    oom = simulate(config, card).oom
    if oom is None:
        return
    assert oom.free < oom.requested
    assert oom.process_in_use == oom.allocated + oom.reserved_unallocated + NON_PYTORCH_BYTES
    assert oom.process_in_use + oom.cotenant + oom.free == oom.total
    assert 1 <= oom.step <= 6
