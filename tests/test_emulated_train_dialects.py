"""Reading launch commands, node fixtures and rank placement; the printed formats."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from emulation.dialects import LaunchError, infer_dialect, parse_launch
from emulation.messages import (
    StepReport,
    deepspeed_line,
    format_size,
    hf_log_line,
    megatron_line,
    oom_message,
    tqdm_line,
    watchdog_lines,
)
from emulation.model import GIB, MIB, AllocatorConf, AllocKind, OomEvent, Phase, Recompute
from emulation.runner import resolve_settings
from emulation.settings import Dialect
from emulation.topology import (
    DEFAULT_XID_LOST_GIB,
    NodeFixture,
    TopologyError,
    expand_nodelist,
    parse_fixture,
    placement_from_env,
)
from hypothesis import given
from hypothesis import strategies as st


def test_hf_flags_map_onto_knobs_and_unknown_ones_are_reported() -> None:
    parsed = parse_launch(
        [
            "--dialect",
            "hf",
            "run_clm.py",
            "--per_device_train_batch_size=4",
            "--gradient_accumulation_steps",
            "16",
            "--gradient_checkpointing",
            "--bf16",
            "--per_device_eval_batch_size",
            "2",
            "--eval_accumulation_steps",
            "1",
            "--dataloader_num_workers",
            "3",
            "--optim",
            "adamw_bnb_8bit",
            "--lr_scheduler_type",
            "cosine",
            "--eval_strategy",
            "no",
        ],
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
    )
    assert parsed.dialect is Dialect.HF
    assert parsed.overrides == {
        "micro_batch": 4,
        "grad_accum": 16,
        "recompute": Recompute.FULL,
        "eval_batch": 2,
        "eval_accumulation_steps": 1,
        "dataloader_workers": 3,
        "optimizer_8bit": True,
        "eval_every": None,
        "allocator": AllocatorConf(expandable_segments=True),
    }
    assert parsed.ignored == ("run_clm.py", "--bf16", "--lr_scheduler_type cosine")


def test_hf_boolean_flag_takes_an_explicit_false() -> None:
    parsed = parse_launch(["--gradient_checkpointing", "False", "--max_steps", "9"], {})
    assert parsed.dialect is Dialect.HF
    assert parsed.overrides == {"recompute": Recompute.NONE, "max_steps": 9}


def test_megatron_global_batch_gives_grad_accum_and_distributed_optimizer_zero1() -> None:
    parsed = parse_launch(
        [
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "64",
            "--use-distributed-optimizer",
            "--recompute-granularity",
            "selective",
            "--tensor-model-parallel-size",
            "2",
            "--recompute-modules",
            "core_attn",
            "mlp",
        ],
        {},
    )
    assert parsed.dialect is Dialect.MEGATRON
    settings = resolve_settings(parsed)
    config = settings.train_config(world_size=8)
    assert (config.data_parallel, config.grad_accum, config.global_batch) == (4, 8, 64)
    assert (config.zero_stage, config.recompute) == (1, Recompute.SELECTIVE)
    assert parsed.ignored == ("--recompute-modules core_attn", "mlp")


def test_deepspeed_config_auto_defers_to_flags(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": 4,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            }
        )
    )
    parsed = parse_launch(["--per_device_train_batch_size", "8", "--deepspeed", str(config)], {})
    assert parsed.dialect is Dialect.DEEPSPEED
    assert parsed.overrides == {
        "micro_batch": 8,
        "grad_accum": 4,
        "zero_stage": 2,
        "offload_optimizer": True,
    }


@pytest.mark.parametrize(
    "content",
    [
        '{"zero_optimization": {"stage": 5}}',
        "[1, 2]",
        '{"train_micro_batch_size_per_gpu": -1}',
        "{not json",
    ],
)
def test_bad_deepspeed_configs_are_refused(tmp_path: Path, content: str) -> None:
    config = tmp_path / "ds.json"
    config.write_text(content)
    with pytest.raises(LaunchError, match="--deepspeed"):
        parse_launch(["--deepspeed_config", str(config)], {})


def test_torchrun_reads_env_knobs_and_emulation_env() -> None:
    parsed = parse_launch(
        ["train.py"],
        {
            "MICRO_BATCH": "4",
            "GRAD_ACCUM": "2",
            "RECOMPUTE": "full",
            "ZERO_STAGE": "3",
            "EVAL_ACCUM": "2",
            "RESUME_FROM": "/ckpt",
            "EMULATION_SCENARIO": "cotenant",
            "EMULATION_NCCL_TIMEOUT_SECONDS": "5",
        },
    )
    assert parsed.dialect is Dialect.TORCHRUN
    assert parsed.scenario == "cotenant"
    assert parsed.overrides == {
        "nccl_timeout_seconds": 5.0,
        "micro_batch": 4,
        "grad_accum": 2,
        "recompute": Recompute.FULL,
        "zero_stage": 3,
        "eval_accumulation_steps": 2,
        "resume_from": "/ckpt",
    }


def test_flags_win_over_the_scenario_preset() -> None:
    settings = resolve_settings(
        parse_launch(["--scenario", "true-oom-step0", "--per_device_train_batch_size", "3"], {})
    )
    assert (settings.scenario, settings.micro_batch, settings.grad_accum) == (
        "true-oom-step0",
        3,
        4,
    )


def test_dialect_inference() -> None:
    assert infer_dialect(["--deepspeed", "x.json", "--per_device_train_batch_size", "1"]) is (
        Dialect.DEEPSPEED
    )
    assert infer_dialect(["--output_dir=/o"]) is Dialect.HF
    assert infer_dialect(["--train-iters", "5"]) is Dialect.MEGATRON
    assert infer_dialect(["train.py", "--lr", "1"]) is Dialect.TORCHRUN


def test_nodelists_expand_like_slurm() -> None:
    assert expand_nodelist("gpu-[01-03,07],login1") == (
        "gpu-01",
        "gpu-02",
        "gpu-03",
        "gpu-07",
        "login1",
    )
    assert expand_nodelist("gpu-04") == ("gpu-04",)
    with pytest.raises(TopologyError, match="node range"):
        expand_nodelist("gpu-[a-b]")


def test_placement_prefers_torchrun_variables_and_maps_ranks_to_nodes() -> None:
    placement = placement_from_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "4",
            "SLURMD_NODENAME": "gpu-03",
            "SLURM_JOB_NODELIST": "gpu-[01-04]",
        },
        "host",
    )
    assert (placement.rank, placement.world_size, placement.ranks_per_node) == (5, 8, 2)
    assert [placement.node_of(rank) for rank in range(8)] == [
        "gpu-01",
        "gpu-01",
        "gpu-02",
        "gpu-02",
        "gpu-03",
        "gpu-03",
        "gpu-04",
        "gpu-04",
    ]
    with pytest.raises(TopologyError, match="not an integer"):
        placement_from_env({"SLURM_PROCID": "one"}, "host")


def test_node_fixture_schema() -> None:
    assert parse_fixture('{"xid": 79}', "f") == NodeFixture(
        xid=79, card_bytes_lost=DEFAULT_XID_LOST_GIB * GIB
    )
    assert parse_fixture('{"cotenant_bytes": 1024}', "f").cotenant_pid is not None
    assert parse_fixture("{}", "f") == NodeFixture()
    for bad, problem in [
        ('{"xid": "79"}', "non-negative integer"),
        ('{"gpu": 1}', "unknown keys"),
        ("[]", "JSON object"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(TopologyError, match=problem):
            parse_fixture(bad, "f")


def test_sizes_print_like_pytorch() -> None:
    assert format_size(0) == "0 bytes"
    assert format_size(1024) == "1024 bytes"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(544 * MIB) == "544.00 MiB"
    assert format_size(GIB) == "1024.00 MiB"
    assert format_size(79 * GIB + GIB // 5) == "79.20 GiB"


def test_oom_message_names_a_cotenant_only_when_there_is_one() -> None:
    event = OomEvent(
        step=1,
        phase=Phase.FORWARD,
        kind=AllocKind.LINEAR,
        requested=GIB,
        allocated=40 * GIB,
        reserved_unallocated=MIB,
        non_pytorch=512 * MIB,
        cotenant=30 * GIB,
        total=80 * GIB,
    )
    text = oom_message(event, device=1, cotenant_pid=77)
    assert "GPU 1 has a total capacity of 80.00 GiB of which 9.50 GiB is free. " in text
    assert "Process 77 has 30.00 GiB memory in use. Including non-PyTorch memory" in text
    alone = oom_message(event, device=0, cotenant_pid=None)
    assert "Process" not in alone


def test_tqdm_line_draws_partial_blocks() -> None:
    report = StepReport(
        step=12,
        max_steps=400,
        loss=2.0,
        learning_rate=1e-4,
        elapsed_s=10.0,
        step_s=0.8,
        global_batch=64,
        micro_batch=2,
    )
    assert tqdm_line(report) == "  3%|▎         | 12/400 [00:10<05:10,  1.25it/s]"


SAMPLES = Path(__file__).resolve().parent / "data" / "emulation"


def skeleton(line: str) -> str:
    """A line's shape: numbers, size units, tqdm's bar and runs of spaces made uniform."""
    shape = re.sub(r"\|[^|]*\|", "|BAR|", line) if "%|" in line else line
    shape = re.sub(r"\d+", "N", shape)
    shape = re.sub(r"N(\.N)? (GiB|MiB|KiB|bytes)", "SIZE", shape)
    shape = re.sub(r"N\.NE[-+]N", "N", shape)
    shape = re.sub(r"N(\.N)?(e-N)?", "N", shape)
    return re.sub(r"\s+", " ", shape).strip()


def sample(name: str) -> list[str]:
    return (SAMPLES / name).read_text(encoding="utf-8").splitlines()


def test_output_matches_real_formats() -> None:
    report = StepReport(
        step=12,
        max_steps=400,
        loss=2.3,
        learning_rate=1.5e-5,
        elapsed_s=62.0,
        step_s=2.83,
        global_batch=1024,
        micro_batch=2,
    )
    event = OomEvent(
        step=1,
        phase=Phase.FORWARD,
        kind=AllocKind.LINEAR,
        requested=3 * GIB,
        allocated=6 * GIB,
        reserved_unallocated=396 * MIB,
        non_pytorch=512 * MIB,
        cotenant=0,
        total=10 * GIB,
    )
    assert skeleton(oom_message(event, device=0, cotenant_pid=None)) == skeleton(
        sample("torch_oom.txt")[0]
    )
    watchdog = watchdog_lines(
        rank=1, seq_num=808, numel=9801523, timeout_ms=600000, ran_ms=600020, now=0.0
    )
    assert [skeleton(line) for line in watchdog[:2]] == [
        skeleton(line) for line in sample("nccl_watchdog.txt")
    ]
    megatron = re.sub(r"^ \[[\d-]+ [\d:]+\]", "", megatron_line(report, 0.0))
    assert skeleton(megatron) == skeleton(sample("megatron_iteration.txt")[0])
    assert skeleton(deepspeed_line(report, 0.0)) == skeleton(sample("deepspeed_step.txt")[0])
    hf_loss, hf_bar = sample("hf_progress.txt")
    assert skeleton(hf_log_line(report, epoch=0.01)) == skeleton(hf_loss)
    long_run = replace(report, step=22, max_steps=1752)
    assert skeleton(tqdm_line(long_run)) == skeleton(hf_bar)


_FLAG_WORDS = st.sampled_from(
    [
        "--per_device_train_batch_size",
        "--micro-batch-size",
        "--gradient_checkpointing",
        "--use-distributed-optimizer",
        "--scenario",
        "--step-seconds",
        "--oom-rank",
        "--optim",
        "--eval_strategy",
        "--unknown",
        "--dialect",
        "train.py",
        "-x",
        "--",
    ]
)
_VALUES = st.one_of(
    st.text(max_size=12), st.integers(-3, 40).map(str), st.sampled_from(["true", "False"])
)


@given(argv=st.lists(st.one_of(_FLAG_WORDS, _VALUES), max_size=12), env_value=st.text(max_size=20))
def test_any_launch_is_parsed_or_refused_with_a_launch_error(
    argv: list[str], env_value: str
) -> None:
    """Odd argv and env (Unicode, empty, negative, missing values) never crash the parser."""
    env = {"MICRO_BATCH": env_value, "PYTORCH_ALLOC_CONF": env_value}
    refusal = ""
    try:
        parsed = parse_launch(argv, env)
    except LaunchError as error:
        refusal = str(error)
    if refusal:
        return
    assert isinstance(parsed.dialect, Dialect)
    for value in parsed.overrides.values():
        if isinstance(value, int) and not isinstance(value, bool):
            assert value >= 0
