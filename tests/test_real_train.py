"""The real training run: real DDP over gloo, real DCP checkpoints, the injected OOM, a real hang.

Runs the real entry point as two local processes on loopback (RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set as torchrun sets them; the Slurm node list only places ranks on two modelled
nodes), and the injection's hooks in-process. No cluster needed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from emulation.dialects import parse_launch
from emulation.messages import oom_message
from emulation.model import GIB, AllocKind, OomEvent, Phase
from emulation.runner import find_failure, resolve_settings
from emulation.settings import Settings
from emulation.topology import NodeFixture, placement_from_env
from realtrain.data import SyntheticTokens
from realtrain.distributed import master_port_for, rank_env
from realtrain.hf import tiny_gpt2
from realtrain.injection import Injection, arm, plan_injection
from realtrain.model import TinyGPT, tiny_gpt
from realtrain.runner import BANNER
from torch.distributed.checkpoint.filesystem import FileSystemReader

from daemon.diagnosis import FailureKind, History
from daemon.evidence.joblog import scan_log
from daemon.evidence.records import Evidence
from daemon.rules.dispatch import diagnose
from tests.loopback_ranks import free_port, loopback_rank_env

REAL_TRAIN = Path(__file__).resolve().parent.parent / "deploy" / "devcluster" / "real-train"
WORLD = 2
TIMEOUT_S = 3
RUN_TIMEOUT_S = 120
STEP_LINE = re.compile(r"^step (?P<step>\d+)/(?P<total>\d+) \| loss (?P<loss>[\d.]+) \| ")
FAILED_RUN_ENV = {
    "EMULATION_SCENARIO": "fragmentation",
    "EMULATION_NCCL_TIMEOUT_SECONDS": str(TIMEOUT_S),
    "MAX_STEPS": "6",
    "SAVE_EVERY": "2",
}
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def launch_env(rank: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    pacing = {"EMULATION_STEP_SECONDS": "0", "NUM_WORKERS": "1", "REALTRAIN_WORKER_MIB": "8"}
    return loopback_rank_env(rank, WORLD, port, **{**pacing, **extra})


@dataclass(frozen=True)
class RankResult:
    returncode: int
    stdout: str
    stderr: str


def launch(cwd: Path, extra: dict[str, str]) -> list[RankResult]:
    """Every rank of one run, started together; results in rank order."""
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(REAL_TRAIN)],
            env=launch_env(rank, port, extra),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(WORLD)
    ]
    results = []
    for process in ranks:
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
        results.append(RankResult(process.returncode, out.decode(), err.decode()))
    return results


def losses(stdout: str) -> dict[int, str]:
    return {
        int(match["step"]): match["loss"]
        for match in map(STEP_LINE.match, stdout.splitlines())
        if match is not None
    }


def modelled_oom(extra: dict[str, str]) -> OomEvent:
    """What the emulator's model says this launch dies of (rank 1 of 2 is the last rank)."""
    env = launch_env(WORLD - 1, 0, extra)
    settings = resolve_settings(parse_launch([], env))
    placement = placement_from_env(env, "localhost")
    failure = find_failure(settings.train_config(WORLD), settings, placement, {}, 0)
    assert failure is not None
    assert failure.oom is not None
    return failure.oom


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RankResult]]:
    """The fragmentation scenario from scratch: rank 1 dies at step 4, rank 0 hangs."""
    work = tmp_path_factory.mktemp("real-train")
    ckpt = work / "ckpt"
    return ckpt, launch(work, {**FAILED_RUN_ENV, "CKPT_DIR": str(ckpt)})


def test_the_modelled_rank_dies_of_the_injected_oom_in_real_frames(
    failed_run: tuple[Path, list[RankResult]],
) -> None:
    _, (survivor, dead) = failed_run
    assert survivor.stdout.splitlines()[0] == BANNER
    assert dead.returncode == 1
    oom = modelled_oom(FAILED_RUN_ENV)
    assert (oom.step, oom.phase, oom.kind) == (4, Phase.FORWARD, AllocKind.LOGITS)
    lines = dead.stderr.splitlines()
    assert f"[rank1]: {oom_message(oom, device=0, cotenant_pid=None)}" in lines
    assert lines[0] == "[rank1]: Traceback (most recent call last):"
    trace = "\n".join(lines)
    # Real frames: DDP's forward, the torch.nn GPT-2's LM head, the module call that ran the hook.
    assert re.search(r'torch/nn/parallel/distributed\.py", line \d+, in _run_ddp_forward', trace)
    assert re.search(r'realtrain/model\.py", line \d+, in forward', trace)
    assert "transformers/" not in trace
    assert "[rank1]:     logits = self.lm_head(hidden_states)" in lines
    assert [step for step in losses(survivor.stdout)] == [1, 2, 3]


def test_the_other_rank_hangs_in_the_real_allreduce_until_gloos_timeout(
    failed_run: tuple[Path, list[RankResult]],
) -> None:
    _, (survivor, _dead) = failed_run
    assert survivor.returncode == 1
    # The dead rank's process stayed up holding its sockets: no "Connection closed by peer".
    assert "Connection closed by peer" not in survivor.stderr
    last = survivor.stderr.splitlines()[-1]
    assert re.fullmatch(
        rf"\[rank0\]: RuntimeError: \[[^\]]*gloo/transport/tcp/\w+\.cc:\d+\] "
        rf"Timed out waiting {TIMEOUT_S * 1000}ms for recv operation to complete",
        last,
    ), last
    assert re.search(
        r'torch/autograd/graph\.py", line \d+, in _engine_run_backward', survivor.stderr
    )


def test_checkpoints_are_real_dcp_directories_one_shard_per_rank(
    failed_run: tuple[Path, list[RankResult]],
) -> None:
    ckpt, (survivor, _dead) = failed_run
    assert sorted(path.name for path in ckpt.iterdir()) == ["step_2"]
    assert sorted(path.name for path in (ckpt / "step_2").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert f"saved checkpoint {ckpt / 'step_2'} at step 2" in survivor.stdout.splitlines()
    keys = FileSystemReader(str(ckpt / "step_2")).read_metadata().state_dict_metadata
    assert "model.lm_head.weight" in keys
    assert "optimizer.state.transformer.wte.weight.exp_avg_sq" in keys
    assert "progress.step" in keys


def test_the_projects_log_scanner_and_rules_read_the_real_failure(
    failed_run: tuple[Path, list[RankResult]], tmp_path: Path
) -> None:
    _, results = failed_run
    log = tmp_path / "job.out"
    log.write_text(
        "".join(result.stdout + result.stderr for result in results)
        + "srun: error: gpu-01: task 0: Exited with exit code 1\n"
        + "srun: error: gpu-02: task 1: Exited with exit code 1\n"
    )
    findings = scan_log(log)
    verdict = diagnose(Evidence(log=findings, expandable_segments=False), History())
    oom = modelled_oom(FAILED_RUN_ENV)
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert (verdict.rank, verdict.node, verdict.phase.value) == (1, "gpu-02", "forward")
    # The dying step's progress line is never printed: the log's last step is the one before.
    assert verdict.step == oom.step - 1
    assert findings.cascade_ranks == (0,)
    assert verdict.oom is not None
    assert verdict.oom.requested_bytes == pytest.approx(oom.requested, abs=0.006 * GIB)
    assert verdict.oom.reserved_unallocated_bytes == pytest.approx(
        oom.reserved_unallocated, abs=0.006 * GIB
    )


def test_the_first_fix_resumes_from_the_real_checkpoint_and_repeats_the_uninterrupted_run(
    failed_run: tuple[Path, list[RankResult]], tmp_path: Path
) -> None:
    ckpt, _ = failed_run
    relaunch = launch(
        tmp_path, {**FAILED_RUN_ENV, **EXPANDABLE, "CKPT_DIR": str(ckpt), "RESUME_FROM": "latest"}
    )
    assert [result.returncode for result in relaunch] == [0, 0], relaunch[1].stderr
    lines = relaunch[0].stdout.splitlines()
    assert f"resumed from checkpoint {ckpt / 'step_2'} at step 2" in lines
    assert lines[-1] == "[real-train] training completed at step 6"
    assert sorted(path.name for path in ckpt.iterdir()) == ["step_2", "step_4", "step_6"]
    assert (ckpt / "step_6" / ".metadata").is_file()
    # The same run without the death: a resume that restored weights, Adam's moments, the
    # schedule and the step prints the very losses it prints.
    uninterrupted = launch(tmp_path, {**FAILED_RUN_ENV, **EXPANDABLE})
    assert [result.returncode for result in uninterrupted] == [0, 0]
    expected = losses(uninterrupted[0].stdout)
    resumed = losses(relaunch[0].stdout)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert resumed == {step: expected[step] for step in resumed}


# --- the injection, in-process -------------------------------------------------------------


def settings_for(scenario: str) -> Settings:
    return resolve_settings(parse_launch(["--scenario", scenario], {}))


def test_the_injection_is_the_emulators_verdict_and_host_ram_is_left_to_the_kernel() -> None:
    spot = placement_from_env(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu-[01-04]"}, "gpu-01"
    )
    settings = settings_for("fragmentation")
    injection = plan_injection(settings, spot, {}, start_step=0)
    failure = find_failure(settings.train_config(4), settings, spot, {}, 0)
    assert failure is not None
    assert failure.oom is not None
    assert injection == Injection(
        rank=3,
        step=4,
        phase=Phase.FORWARD,
        kind=AllocKind.LOGITS,
        message=oom_message(failure.oom, device=0, cotenant_pid=None).removeprefix(
            "torch.OutOfMemoryError: "
        ),
    )
    assert plan_injection(settings_for("host-ram"), spot, {}, start_step=0) is None
    assert plan_injection(Settings(), spot, {}, start_step=0) is None
    sick = {"gpu-02": NodeFixture(cotenant_bytes=30 * GIB, cotenant_pid=777)}
    cotenant = plan_injection(settings_for("cotenant"), spot, sick, start_step=0)
    assert cotenant is not None
    assert cotenant.rank == 1
    assert "Process 777 has 30.00 GiB memory in use." in cotenant.message


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, phase: Phase) -> None:
    rows = SyntheticTokens(4).tokens
    if phase is Phase.EVAL:
        model.eval()
        with torch.no_grad():
            if isinstance(model, TinyGPT):
                model.generate(input_ids=rows[:, :8], max_new_tokens=2)
            else:
                model.generate(input_ids=rows[:, :8], max_new_tokens=2, do_sample=False)  # type: ignore[operator]
        model.train()
        return
    model(input_ids=rows, labels=rows).loss.backward()
    optimizer.step()


# The frame each phase's OOM is raised under: the torchrun dialect's torch.nn GPT-2, and
# transformers' GPT-2, which the hf dialect's Trainer runs.
TORCH_FRAMES = {
    AllocKind.ATTENTION: "attn_output: torch.Tensor = self.attn(self.ln_1(hidden_states))",
    AllocKind.LINEAR: "feed_forward_hidden_states: torch.Tensor = self.mlp(self.ln_2(",
    AllocKind.KV_CACHE: "logits = self(input_ids=tokens[:, -self.positions :]).logits",
}
HF_FRAMES = {
    AllocKind.ATTENTION: "attn_output, _ = self.attn(",
    AllocKind.LINEAR: "feed_forward_hidden_states = self.mlp(",
    AllocKind.KV_CACHE: "outputs = self._prefill(",
}
SHARED_FRAMES = {
    AllocKind.LOGITS: "logits = self.lm_head(hidden_states)",
    AllocKind.ACTIVATION_GRAD: "return Variable._execution_engine",
    AllocKind.ADAM_UPDATE: "result = pre_hook(self, args, kwargs)",
    AllocKind.WEIGHTS: "args_result = hook(self, args)",
}
PHASE_KINDS = (
    (Phase.FORWARD, AllocKind.ATTENTION),
    (Phase.FORWARD, AllocKind.LINEAR),
    (Phase.FORWARD, AllocKind.LOGITS),
    (Phase.BACKWARD, AllocKind.ACTIVATION_GRAD),
    (Phase.OPTIMIZER, AllocKind.ADAM_UPDATE),
    (Phase.EVAL, AllocKind.KV_CACHE),
    (Phase.SETUP, AllocKind.WEIGHTS),
)


@pytest.mark.parametrize(
    ("make_model", "frames"),
    [(tiny_gpt, {**TORCH_FRAMES, **SHARED_FRAMES}), (tiny_gpt2, {**HF_FRAMES, **SHARED_FRAMES})],
    ids=["torchrun", "hf"],
)
@pytest.mark.parametrize(("phase", "kind"), PHASE_KINDS)
def test_each_phase_raises_from_inside_its_real_call_at_its_step_only(
    make_model: Callable[[], torch.nn.Module],
    frames: dict[AllocKind, str],
    phase: Phase,
    kind: AllocKind,
) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    step = [1]
    current: Callable[[], int] = lambda: step[0]  # noqa: E731
    arm(model, optimizer, Injection(1, 2, phase, kind, "CUDA out of memory. Tried"), 1, current)
    _step(model, optimizer, phase)  # step 1: not yet
    step[0] = 2
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried\Z") as caught:
        _step(model, optimizer, phase)
    assert frames[kind] in "".join(traceback.format_tb(caught.value.__traceback__))


def test_other_ranks_are_never_armed() -> None:
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    injection = Injection(1, 1, Phase.FORWARD, AllocKind.LOGITS, "CUDA out of memory.")
    arm(model, optimizer, injection, 0, lambda: 1)
    _step(model, optimizer, Phase.FORWARD)
    assert not model.lm_head._forward_hooks


def test_the_torch_gpt_refuses_padding_and_decodes_greedily() -> None:
    model = tiny_gpt().eval()
    rows = SyntheticTokens(2).tokens
    padded = torch.ones_like(rows)
    padded[0, -1] = 0
    with pytest.raises(ValueError, match="unpadded"):
        model(input_ids=rows, attention_mask=padded)
    out = model.generate(rows[:, :8], max_new_tokens=3)
    assert out.shape == (2, 11)
    assert torch.equal(out[:, :8], rows[:, :8])
    with torch.no_grad():
        likeliest = model(input_ids=out[:, :10]).logits[:, -1].argmax(dim=-1)
    assert torch.equal(out[:, 10], likeliest)


def test_a_dead_rank_lingers_holding_its_sockets_and_a_finished_one_does_not() -> None:
    program = (
        "import sys; sys.path.insert(0, {path!r})\n"
        "from realtrain.injection import linger_after_death\n"
        "linger_after_death(60)\n"
        "print('ready', flush=True)\n"
        "{ending}\n"
    )
    path = str(REAL_TRAIN.parent)
    finished = subprocess.run(
        [sys.executable, "-c", program.format(path=path, ending="sys.exit(0)")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (finished.returncode, finished.stdout) == (0, "ready\n")
    dying = subprocess.Popen(
        [sys.executable, "-c", program.format(path=path, ending="raise MemoryError('x')")],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert dying.stderr is not None
        assert dying.stderr.readline() == "Traceback (most recent call last):\n"
        while not (line := dying.stderr.readline()).startswith("MemoryError"):
            assert line
        # The traceback is out, and the process is still there.
        assert dying.poll() is None
    finally:
        dying.kill()
        dying.communicate()


def test_rank_env_reads_srun_and_lets_torchrun_win() -> None:
    srun = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": "gpu-[02-04,07]",
        "SLURM_JOB_NODELIST": "gpu-[01-08]",
        "SLURMD_NODENAME": "gpu-04",
    }
    mine = rank_env(srun, "ignored-host")
    assert (mine.rank, mine.world_size, mine.local_rank, mine.node) == (5, 8, 1, "gpu-04")
    assert (mine.master_addr, mine.master_port) == ("gpu-02", master_port_for(123456))
    assert master_port_for(123456) != master_port_for(123457)
    assert 1024 < master_port_for(123456) < 32768
    torchrun = {**srun, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    torchrun |= {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500"}
    theirs = rank_env(torchrun, "ignored-host")
    assert (theirs.rank, theirs.world_size, theirs.local_rank) == (2, 4, 0)
    assert (theirs.master_addr, theirs.master_port) == ("10.0.0.9", 29500)
