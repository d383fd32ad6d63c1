"""The emulated run as a process: its log, checkpoints, resume, OOM text, hang and kill.

Runs the real entry point (under the system python3, as on the nodes) with a faked SLURM
environment for rank and world; no cluster needed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from emulation.dialects import parse_launch
from emulation.messages import EMULATION_BANNER
from emulation.model import GIB, MIB, OomEvent
from emulation.runner import find_failure, resolve_settings
from emulation.topology import placement_from_env, read_fixture

EMULATED_TRAIN = Path(__file__).resolve().parent.parent / "deploy" / "devcluster" / "emulated-train"
FAST = ["--step-seconds", "0.01", "--save-seconds", "0"]

OOM_LINE = re.compile(
    r"^\[rank(?P<rank>\d+)\]: torch\.OutOfMemoryError: CUDA out of memory\. "
    r"Tried to allocate (?P<requested>[\d.]+ (?:GiB|MiB|KiB|bytes))\. "
    r"GPU (?P<device>\d+) has a total capacity of (?P<total>[\d.]+ (?:GiB|MiB)) "
    r"of which (?P<free>[\d.]+ (?:GiB|MiB|KiB|bytes)) is free\. "
    r"(?:Process (?P<pid>\d+) has (?P<other>[\d.]+ (?:GiB|MiB)) memory in use\. )?"
    r"Including non-PyTorch memory, this process has "
    r"(?P<in_use>[\d.]+ (?:GiB|MiB)) memory in use\. "
    r"Of the allocated memory (?P<allocated>[\d.]+ (?:GiB|MiB)) is allocated by PyTorch, "
    r"and (?P<unallocated>[\d.]+ (?:GiB|MiB|KiB|bytes)) is reserved by PyTorch but unallocated\. "
    r"If reserved but unallocated memory is large try setting "
    r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation\.  "
    r"See documentation for Memory Management  "
    r"\(https://pytorch\.org/docs/stable/notes/cuda\.html#environment-variables\)$",
    re.MULTILINE,
)
WATCHDOG_LINE = re.compile(
    # Not anchored: as in real logs, it can follow tqdm's unfinished redraw on one line.
    r"\[rank(?P<rank>\d+)\]:\[E\d{4} [\d:.]+ ProcessGroupNCCL\.cpp:\d+\] \[Rank (?P=rank)\] "
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), "
    r"OpType=ALLREDUCE, NumelIn=\d+, NumelOut=\d+, Timeout\(ms\)=(?P<timeout>\d+)\) "
    r"ran for (?P<ran>\d+) milliseconds before timing out\.$",
    re.MULTILINE,
)
UNITS = {"GiB": GIB, "MiB": MIB, "KiB": 1024, "bytes": 1}


def to_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def rank_env(rank: int, world: int, node: str = "gpu-01", **extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLURM", "EMULATION_", "PYTORCH_"))
        and key not in ("RANK", "WORLD_SIZE")
    }
    env.update(
        SLURM_PROCID=str(rank),
        SLURM_NTASKS=str(world),
        SLURM_LOCALID="0",
        SLURMD_NODENAME=node,
        SLURM_JOB_NODELIST=f"gpu-[01-0{world}]" if world > 1 else node,
        DEVCLUSTER_STATE="/nonexistent-devcluster-state",
    )
    env.update(extra)
    return env


def emulate(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the real entry point; output decoded by hand so tqdm's carriage returns survive."""
    raw = subprocess.run(
        [str(EMULATED_TRAIN), *args, *FAST],
        env=env,
        cwd=cwd,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return subprocess.CompletedProcess(
        raw.args, raw.returncode, raw.stdout.decode(), raw.stderr.decode()
    )


def model_oom(args: list[str], env: dict[str, str]) -> OomEvent:
    """What the memory model says the run dies of, computed in-process from the same inputs."""
    parsed = parse_launch(args, env)
    settings = resolve_settings(parsed)
    placement = placement_from_env(env, "localhost")
    config = settings.train_config(placement.world_size)
    fixtures = {node: read_fixture(env["DEVCLUSTER_STATE"], node) for node in placement.nodes}
    failure = find_failure(config, settings, placement, fixtures, 0)
    assert failure is not None
    assert failure.oom is not None
    return failure.oom


def test_hf_run_logs_each_step_writes_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        "--dialect",
        "hf",
        "--scenario",
        "true-oom-step0",
        "--per_device_train_batch_size",
        "3",
        "--gradient_accumulation_steps",
        "8",
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--bf16",
        "--report_to",
        "none",
        "run_clm.py",
    ]
    first = emulate(args, rank_env(0, 1), tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0] == EMULATION_BANNER
    assert lines[1].endswith("--bf16 --report_to none run_clm.py")
    loss_lines = [line for line in lines if line.startswith("{'loss': ")]
    assert len(loss_lines) == 4
    assert re.fullmatch(
        r"\{'loss': [\d.]+, 'grad_norm': [\d.]+, 'learning_rate': [\d.e-]+, 'epoch': [\d.]+\}",
        loss_lines[0],
    )
    assert "\r100%|██████████| 4/4 [" in first.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    safetensors = (out / "checkpoint-4" / "model.safetensors").read_bytes()
    header_len = int.from_bytes(safetensors[:8], "little")
    assert json.loads(safetensors[8 : 8 + header_len])["__metadata__"]["emulation"] == "true"

    resumed = emulate(
        [*args[:-4], "--max_steps", "6", "--resume_from_checkpoint", "latest"],
        rank_env(0, 1),
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "  Continuing training from global step 4" in resumed.stdout.splitlines()
    assert sum(line.startswith("{'loss': ") for line in resumed.stdout.splitlines()) == 2
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()


def test_half_written_hf_checkpoint_refuses_to_resume(tmp_path: Path) -> None:
    half = tmp_path / "out" / "checkpoint-8"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"\0" * 8)
    args = ["--dialect", "hf", "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint"]
    latest = emulate([*args, "latest"], rank_env(0, 1), tmp_path)
    assert latest.returncode == 1
    assert f"No such file or directory: '{half / 'trainer_state.json'}'" in latest.stderr
    missing = emulate([*args, str(tmp_path / "out" / "checkpoint-3")], rank_env(0, 1), tmp_path)
    assert missing.returncode == 1
    assert "ValueError: Can't find a valid checkpoint at" in missing.stderr


def test_megatron_layout_tracker_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [
        "--dialect",
        "megatron",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "32",
        "--num-layers",
        "8",
        "--hidden-size",
        "1024",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "1024",
        "--train-iters",
        "4",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "2",
        "--tensor-model-parallel-size",
        "2",
    ]
    first = emulate(args, rank_env(0, 1), tmp_path)
    assert first.returncode == 0, first.stderr
    iterations = [line for line in first.stdout.splitlines() if "| consumed samples:" in line]
    assert len(iterations) == 4
    assert re.search(
        r"iteration\s+3/\s+4 \| consumed samples:\s+96 \| "
        r"elapsed time per iteration \(ms\): [\d.]+ \|.*\| lm loss: [\d.]+E\+00 \|",
        iterations[2],
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert (ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert (ckpt / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt").is_file()
    resumed = emulate(
        [*args[:-6], "--train-iters", "5", "--save", str(ckpt), "--load", str(ckpt)],
        rank_env(0, 1),
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert (
        f"successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/1 ] at iteration 4"
        in resumed.stdout
    )
    assert sum("| consumed samples:" in line for line in resumed.stdout.splitlines()) == 1


def test_deepspeed_config_layout_and_resume(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": "auto",
                "zero_optimization": {"stage": 1},
            }
        )
    )
    out = tmp_path / "out"
    args = [
        "--deepspeed",
        str(config),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--save_steps",
        "3",
    ]
    first = emulate(args, rank_env(0, 2, SLURM_JOB_NODELIST="gpu-[01-02]"), tmp_path)
    assert first.returncode == 0, first.stderr
    assert re.search(
        r"^\[[\d-]+ [\d:]+,\d{3}\] \[INFO\] \[logging\.py:\d+:log_dist\] "
        r"\[Rank 0\] step=2, skipped=0, lr=\[",
        first.stdout,
        re.MULTILINE,
    )
    assert (out / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in (out / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    resumed = emulate(
        [*args, "--load_dir", str(out), "--max_steps", "4"],
        rank_env(0, 2, SLURM_JOB_NODELIST="gpu-[01-02]"),
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "[Rank 0] resumed from global_step3 at step 3" in resumed.stdout


def test_torchrun_env_knobs_dcp_layout_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "dcp"
    env = rank_env(0, 1, MAX_STEPS="4", SAVE_EVERY="2", CKPT_DIR=str(ckpt), MICRO_BATCH="1")
    first = emulate(["train.py"], env, tmp_path)
    assert first.returncode == 0, first.stderr
    step_lines = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert step_lines[0].startswith("step 1/4 | loss ")
    assert (ckpt / "step_4" / ".metadata").is_file()
    assert (ckpt / "step_4" / "__0_0.distcp").is_file()
    (ckpt / "step_6").mkdir()  # a save killed before .metadata: not a resume point
    resumed = emulate(["train.py"], {**env, "MAX_STEPS": "5", "RESUME_FROM": "latest"}, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint {ckpt / 'step_4'} at step 4" in resumed.stdout


@pytest.mark.parametrize(
    ("args", "extra_env"),
    [
        (["--dialect", "hf", "--scenario", "true-oom-step0"], {}),
        (["--dialect", "megatron", "--scenario", "optimizer-burst"], {}),
        (["--dialect", "torchrun", "--scenario", "fragmentation"], {}),
        (["--dialect", "hf", "--scenario", "eval-growth"], {}),
        (
            ["--dialect", "hf", "--scenario", "fragmentation"],
            {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"},
        ),
    ],
)
def test_failing_rank_prints_the_oom_with_the_models_numbers(
    tmp_path: Path, args: list[str], extra_env: dict[str, str]
) -> None:
    env = rank_env(3, 4, node="gpu-04", **extra_env)
    result = emulate(args, env, tmp_path)
    assert result.returncode == 1
    match = OOM_LINE.search(result.stderr)
    assert match is not None, result.stderr
    oom = model_oom(args, env)
    assert match["rank"] == "3"
    assert match["device"] == "0"
    for group, value in [
        ("requested", oom.requested),
        ("total", oom.total),
        ("free", oom.free),
        ("in_use", oom.process_in_use),
        ("allocated", oom.allocated),
        ("unallocated", oom.reserved_unallocated),
    ]:
        assert to_bytes(match[group]) == pytest.approx(value, abs=0.006 * GIB), group
    assert to_bytes(match["free"]) < to_bytes(match["requested"])
    assert result.stderr.splitlines()[0] == "[rank3]: Traceback (most recent call last):"


def test_oom_traceback_frames_follow_the_phase(tmp_path: Path) -> None:
    optimizer = emulate(
        ["--dialect", "hf", "--scenario", "optimizer-burst"],
        rank_env(3, 4, node="gpu-04"),
        tmp_path,
    )
    assert "self.optimizer.step()" in optimizer.stderr
    assert "torch/optim/adam.py" in optimizer.stderr
    evaluation = emulate(
        ["--dialect", "hf", "--scenario", "eval-growth"], rank_env(3, 4, node="gpu-04"), tmp_path
    )
    assert "in evaluate" in evaluation.stderr
    assert "generate(" in evaluation.stderr
    attention = emulate(
        ["--dialect", "hf", "--scenario", "true-oom-midrun"],
        rank_env(3, 4, node="gpu-04"),
        tmp_path,
    )
    assert "outputs = model(**inputs)" in attention.stderr
    assert "eager_attention_forward" in attention.stderr


def test_cotenant_from_the_node_fixture_names_the_other_process(tmp_path: Path) -> None:
    fixture_dir = tmp_path / "state" / "nodes" / "gpu-02" / "fixture"
    fixture_dir.mkdir(parents=True)
    (fixture_dir / "emulation.json").write_text(
        '{"cotenant_bytes": 32212254720, "cotenant_pid": 4242}'
    )
    args = ["--dialect", "hf", "--scenario", "cotenant"]
    env = rank_env(1, 4, node="gpu-02", DEVCLUSTER_STATE=str(tmp_path / "state"))
    result = emulate(args, env, tmp_path)
    assert result.returncode == 1
    match = OOM_LINE.search(result.stderr)
    assert match is not None, result.stderr
    assert (match["pid"], match["other"]) == ("4242", "30.00 GiB")
    assert to_bytes(match["free"]) == pytest.approx(model_oom(args, env).free, abs=0.006 * GIB)


def test_healthy_ranks_hang_then_the_nccl_watchdog_aborts_them(tmp_path: Path) -> None:
    fixture_dir = tmp_path / "state" / "nodes" / "gpu-03" / "fixture"
    fixture_dir.mkdir(parents=True)
    (fixture_dir / "emulation.json").write_text('{"xid": 79}')
    env = rank_env(0, 4, DEVCLUSTER_STATE=str(tmp_path / "state"))
    result = emulate(
        ["--dialect", "hf", "--scenario", "faulty-node", "--nccl-timeout-seconds", "0.5"],
        env,
        tmp_path,
    )
    assert result.returncode == -signal.SIGABRT
    assert "OutOfMemoryError" not in result.stderr
    match = WATCHDOG_LINE.search(result.stderr)
    assert match is not None, result.stderr
    assert match["rank"] == "0"
    assert match["timeout"] == "500"
    assert int(match["ran"]) >= 500
    assert sum(line.startswith("{'loss': ") for line in result.stdout.splitlines()) == 1


def test_host_ram_kill_prints_nothing_and_dies_of_sigkill(tmp_path: Path) -> None:
    result = emulate(
        ["--dialect", "hf", "--scenario", "host-ram"], rank_env(3, 4, node="gpu-04"), tmp_path
    )
    assert result.returncode == -signal.SIGKILL
    assert result.stdout.splitlines() == [EMULATION_BANNER]
    assert result.stderr == ""
    fixed = emulate(
        [
            "--dialect",
            "hf",
            "--scenario",
            "host-ram",
            "--dataloader_num_workers",
            "8",
            "--max_steps",
            "2",
        ],
        rank_env(3, 4, node="gpu-04"),
        tmp_path,
    )
    assert fixed.returncode == 0, fixed.stderr


@pytest.mark.parametrize(
    ("args", "env_extra", "message"),
    [
        (["--dialect", "hf", "--per_device_train_batch_size", "many"], {}, "expected an integer"),
        (["--dialect", "cobol"], {}, "unknown dialect 'cobol'"),
        (["--scenario", "meteor-strike"], {}, "unknown scenario 'meteor-strike'"),
        (["--dialect", "megatron", "--micro-batch-size"], {}, "--micro-batch-size needs a value"),
        (
            [],
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:maybe"},
            "expandable_segments expects",
        ),
        ([], {"SLURM_PROCID": "7"}, "rank 7 is outside a world of 1"),
        (["--deepspeed", "/nonexistent/ds.json"], {}, "cannot read config"),
    ],
)
def test_bad_launches_fail_with_a_clear_error(
    tmp_path: Path, args: list[str], env_extra: dict[str, str], message: str
) -> None:
    result = emulate(args, rank_env(0, 1, **env_extra), tmp_path)
    assert result.returncode == 2
    assert message in result.stderr


def test_malformed_node_fixture_is_an_error_naming_the_file(tmp_path: Path) -> None:
    fixture = tmp_path / "state" / "nodes" / "gpu-01" / "fixture" / "emulation.json"
    fixture.parent.mkdir(parents=True)
    fixture.write_bytes(b"\xff\xfe{not json")
    result = emulate([], rank_env(0, 1, DEVCLUSTER_STATE=str(tmp_path / "state")), tmp_path)
    assert result.returncode == 2
    assert str(fixture) in result.stderr


def test_a_kill_mid_save_leaves_a_checkpoint_that_cannot_be_resumed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        str(EMULATED_TRAIN),
        "--dialect",
        "hf",
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--step-seconds",
        "0.01",
        "--save-seconds",
        "0.5",
    ]
    with subprocess.Popen(
        argv, env=rank_env(0, 1), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as running:
        weights = out / "checkpoint-2" / "model.safetensors"
        deadline = time.monotonic() + 30
        while not weights.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        running.kill()
    assert weights.is_file()
    assert not (out / "checkpoint-2" / "trainer_state.json").exists()
    resumed = emulate(
        ["--dialect", "hf", "--output_dir", str(out), "--resume_from_checkpoint", "latest"],
        rank_env(0, 1),
        tmp_path,
    )
    assert resumed.returncode == 1
    assert "trainer_state.json" in resumed.stderr


def test_the_projects_log_scanner_reads_the_emulated_failure(tmp_path: Path) -> None:
    """The job log of a wedged 4-rank run, as srun merges it, read by daemon.evidence."""
    from daemon.evidence.joblog import scan_log

    args = ["--dialect", "hf", "--scenario", "optimizer-burst", "--nccl-timeout-seconds", "0.2"]
    outputs = [
        emulate(args, rank_env(rank, 4, node=f"gpu-0{rank + 1}"), tmp_path) for rank in range(4)
    ]
    assert [result.returncode for result in outputs] == [-signal.SIGABRT] * 3 + [1]
    log = tmp_path / "job.out"
    log.write_text(
        "".join(result.stdout + result.stderr for result in outputs)
        + "srun: error: gpu-04: task 3: Exited with exit code 1\n"
    )
    findings = scan_log(log)
    oom = model_oom(args, rank_env(3, 4, node="gpu-04"))
    assert (findings.rank, findings.node, findings.phase.value) == (3, "gpu-04", "optimizer_step")
    assert findings.oom is not None
    assert findings.oom.requested_bytes == pytest.approx(oom.requested, abs=0.006 * GIB)
    assert findings.oom.reserved_unallocated_bytes == pytest.approx(
        oom.reserved_unallocated, abs=0.006 * GIB
    )
    assert set(findings.cascade_ranks) == {0, 1, 2}
