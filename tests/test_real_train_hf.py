"""The real HF Trainer dialect as processes: an injected OOM in a real Trainer, real checkpoints,
a real resume.

Two ranks of `deploy/devcluster/real-train --dialect hf` on loopback (RANK/WORLD_SIZE/MASTER_*
as torchrun sets them, the nodes named as srun would), no cluster. The logs they print are
read by the daemon's own scanner and rules, and the checkpoints by its checkpoint finder.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from emulation.dialects import LaunchError, parse_launch
from emulation.model import GIB
from emulation.runner import resolve_settings
from realtrain.hf import trainer_flags, training_arguments
from transformers import TrainingArguments

from daemon.checkpoints import CheckpointLayout, CheckpointSpec, find_last_good
from daemon.config import VerifySettings
from daemon.diagnosis import FailureKind, History
from daemon.evidence.joblog import scan_log
from daemon.evidence.records import Evidence, LogFindings, Phase
from daemon.rules.dispatch import diagnose
from daemon.verify import Progress, judge_progress
from tests.loopback_ranks import free_port, loopback_rank_env
from tests.test_emulated_train_cli import OOM_LINE, model_oom, to_bytes

REAL_TRAIN = Path(__file__).resolve().parent.parent / "deploy" / "devcluster" / "real-train"
WORLD = 2
GLOO_TIMEOUT_S = 3
# The fragmentation preset on 2 ranks: the last rank dies at step 4, in the forward's logits.
FAILING_STEP = 4
SAVE_STEPS = 2
MAX_STEPS = 6
FIX_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
WANTED = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "eval_steps",
    "per_device_eval_batch_size",
    "eval_accumulation_steps",
    "dataloader_num_workers",
    "activation_checkpointing",
    "use_cpu",
    "ddp_backend",
    "ddp_timeout",
    "logging_steps",
    "seed",
    "report_to",
    "disable_tqdm",
)


def launch_args(out: Path) -> list[str]:
    return [
        "--dialect",
        "hf",
        "--scenario",
        "fragmentation",
        "--output_dir",
        str(out),
        "--max_steps",
        str(MAX_STEPS),
        "--save_steps",
        str(SAVE_STEPS),
        "--dataloader_num_workers",
        "0",
        "--logging_steps",
        "1",
        "--bf16",
        # At least tqdm's mininterval (0.1 s), so the Trainer's bar redraws at every step.
        "--step-seconds",
        "0.1",
        "--nccl-timeout-seconds",
        str(GLOO_TIMEOUT_S),
    ]


def rank_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    """One rank per node, as torchrun under srun would start it."""
    return loopback_rank_env(rank, WORLD, port, **{"OMP_NUM_THREADS": "1", **extra})


@dataclass(frozen=True)
class Run:
    """Both ranks' exit codes, the job log they wrote together, and the checkpoints after."""

    returncodes: list[int]
    log: Path
    checkpoints: list[str]

    @property
    def text(self) -> str:
        return self.log.read_text()

    def rank_lines(self, rank: int) -> str:
        """What torch printed for `rank` (prefixed), one per line, wherever a redraw left it."""
        return "\n".join(re.findall(rf"\[rank{rank}\]: [^\r\n]*", self.text))


def run_job(args: list[str], cwd: Path, name: str, **extra: str) -> Run:
    """Both ranks to the end, writing one log as srun merges them; checkpoints go to cwd/out."""
    port = free_port()
    log = cwd / f"{name}.out"
    with log.open("ab") as shared:
        ranks = [
            subprocess.Popen(
                [sys.executable, str(REAL_TRAIN), *args],
                env=rank_env(rank, port, **extra),
                cwd=cwd,
                stdout=shared,
                stderr=subprocess.STDOUT,
            )
            for rank in range(WORLD)
        ]
        returncodes = [process.wait(timeout=90) for process in ranks]
    with log.open("a") as tail:
        for rank, code in enumerate(returncodes):
            if code != 0:
                tail.write(
                    f"srun: error: gpu-0{rank + 1}: task {rank}: Exited with exit code {code}\n"
                )
    checkpoints = sorted(path.name for path in (cwd / "out").glob("checkpoint-*"))
    return Run(returncodes, log, checkpoints)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-hf")


@pytest.fixture(scope="module")
def failed(workdir: Path) -> Run:
    return run_job(launch_args(workdir / "out"), workdir, "failed")


@pytest.fixture(scope="module")
def relaunched(workdir: Path, failed: Run) -> Run:
    # As the daemon writes a relaunch: the checkpoint's own path (`latest` finds the same one).
    checkpoint = workdir / "out" / f"checkpoint-{SAVE_STEPS}"
    args = [*launch_args(workdir / "out"), "--resume_from_checkpoint", str(checkpoint)]
    return run_job(args, workdir, "relaunched", **FIX_ENV)


def read_state(checkpoint: Path) -> dict[str, object]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert isinstance(state, dict)
    return state


def trained_steps(state: dict[str, object]) -> list[int]:
    history = state["log_history"]
    assert isinstance(history, list)
    return [entry["step"] for entry in history if "loss" in entry]


def test_the_modelled_rank_dies_inside_the_real_trainer_with_the_models_numbers(
    failed: Run, workdir: Path
) -> None:
    assert failed.returncodes == [1, 1]
    dying = failed.rank_lines(1)
    for frame in (
        'transformers/trainer.py", line',
        "in compute_loss",
        "torch/nn/parallel/distributed.py",
        "transformers/models/gpt2/modeling_gpt2.py",
        "logits = self.lm_head(hidden_states)",
    ):
        assert frame in dying, frame
    match = OOM_LINE.search(dying)
    assert match is not None, dying
    oom = model_oom(launch_args(workdir / "out"), rank_env(1, 0))
    assert oom.step == FAILING_STEP
    assert match["rank"] == "1"
    for group, value in [
        ("requested", oom.requested),
        ("allocated", oom.allocated),
        ("unallocated", oom.reserved_unallocated),
        ("free", oom.free),
    ]:
        assert to_bytes(match[group]) == pytest.approx(value, abs=0.006 * GIB), group

    findings: LogFindings = scan_log(failed.log)
    # The step read is the last one the bar finished: the death came inside the next.
    assert (findings.rank, findings.node, findings.step) == (1, "gpu-02", FAILING_STEP - 1)
    assert findings.phase is Phase.FORWARD
    assert findings.cascade_ranks == (0,)
    assert findings.oom is not None
    assert findings.oom.requested_bytes == pytest.approx(oom.requested, abs=0.006 * GIB)
    assert findings.oom.reserved_unallocated_bytes == pytest.approx(
        oom.reserved_unallocated, abs=0.006 * GIB
    )
    diagnosis = diagnose(Evidence(log=findings, job=None), History())
    assert diagnosis.kind is FailureKind.FRAGMENTATION


def test_the_survivor_hangs_in_the_real_ddp_allreduce_until_gloo_times_out(failed: Run) -> None:
    survivor = failed.rank_lines(0)
    assert "accelerate/accelerator.py" in survivor
    assert "loss.backward(**kwargs)" in survivor
    assert (
        f"[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        f"unbound_buffer.cc:78] Timed out waiting {GLOO_TIMEOUT_S * 1000}ms for recv operation"
    ) in survivor
    assert f"| {FAILING_STEP - 1}/{MAX_STEPS} [" in failed.text
    assert f"| {FAILING_STEP}/{MAX_STEPS} [" not in failed.text


def test_the_trainer_wrote_real_checkpoints_before_the_death(failed: Run, workdir: Path) -> None:
    # Saved at step 2; the death inside step 4 came before its save.
    assert failed.checkpoints == ["checkpoint-2"]
    checkpoint = workdir / "out" / "checkpoint-2"
    names = {path.name for path in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= names
    assert {f"rng_state_{rank}.pth" for rank in range(WORLD)} <= names
    state = read_state(checkpoint)
    assert state["global_step"] == SAVE_STEPS
    assert trained_steps(state) == [1, 2]
    weights = (checkpoint / "model.safetensors").read_bytes()
    header = json.loads(weights[8 : 8 + int.from_bytes(weights[:8], "little")])
    assert "transformer.wte.weight" in header


def test_the_relaunch_with_the_first_fix_resumes_and_passes_the_failing_step(
    relaunched: Run, workdir: Path
) -> None:
    out = workdir / "out"
    text = relaunched.text
    assert relaunched.returncodes == [0, 0], text
    assert f"Loading model from {out / 'checkpoint-2'}." in text
    assert "  Resuming training from checkpoint with epoch 0 and global step 2" in text
    assert f"[real-train] training completed at step {MAX_STEPS}" in text
    state = read_state(out / f"checkpoint-{MAX_STEPS}")
    assert state["global_step"] == MAX_STEPS
    # The first two steps' history came back with the checkpoint: a real resume.
    assert trained_steps(state) == list(range(1, MAX_STEPS + 1))

    max_step_seen = scan_log(relaunched.log).max_step_seen
    assert max_step_seen == MAX_STEPS
    scan = find_last_good(CheckpointSpec(CheckpointLayout.HF, str(out)))
    assert scan.found is not None
    assert scan.found.step == MAX_STEPS
    verdict = judge_progress(
        failing_step=FAILING_STEP,
        resumed_step=SAVE_STEPS,
        margin_steps=VerifySettings().margin_steps,
        progress=Progress(max_step_seen, scan.found.step),
    )
    assert verdict.verified, verdict.reasons


def test_an_optimizer_death_runs_through_accelerates_wrapped_optimizer(tmp_path: Path) -> None:
    """The hook sits on the torch optimizer inside accelerate's AcceleratedOptimizer."""
    args = ["--dialect", "hf", "--scenario", "optimizer-burst", "--max_steps", "3"]
    args += ["--dataloader_num_workers", "0", "--step-seconds", "0", "--nccl-timeout-seconds", "1"]
    run = run_job(args, tmp_path, "optimizer")
    assert run.returncodes == [1, 1]
    dying = run.rank_lines(1)
    assert "self.optimizer.step()" in dying
    assert "accelerate/optimizer.py" in dying
    assert "torch/optim/optimizer.py" in dying
    findings = scan_log(run.log)
    assert (findings.rank, findings.phase) == (1, Phase.OPTIMIZER_STEP)
    assert findings.oom is not None
    oom = model_oom(args, rank_env(1, 0))
    assert findings.oom.requested_bytes == pytest.approx(oom.requested, abs=0.006 * GIB)
    diagnosis = diagnose(Evidence(log=findings, job=None), History())
    assert diagnosis.kind is FailureKind.OPTIMIZER_BURST


def test_trainer_flags_take_what_the_real_trainer_takes_and_leave_the_rest() -> None:
    flags = trainer_flags(
        ["--logging_steps 5", "--seed=7", "--learning_rate 1e-4", "--bf16", "run_clm.py"]
    )
    assert dict(flags.arguments) == {"logging_steps": 5, "seed": 7, "learning_rate": 1e-4}
    assert flags.unused == ("--bf16", "run_clm.py")
    with pytest.raises(LaunchError, match="--logging_steps"):
        trainer_flags(["--logging_steps often"])


def test_training_arguments_carry_the_emulators_hf_knobs(tmp_path: Path) -> None:
    argv = [
        "--dialect",
        "hf",
        "--per_device_train_batch_size",
        "3",
        "--gradient_accumulation_steps",
        "8",
        "--output_dir",
        str(tmp_path),
        "--save_steps",
        "5",
        "--eval_steps",
        "4",
        "--per_device_eval_batch_size",
        "16",
        "--eval_accumulation_steps",
        "1",
        "--dataloader_num_workers",
        "8",
        "--gradient_checkpointing",
        "--nccl-timeout-seconds",
        "2.5",
    ]
    settings = resolve_settings(parse_launch(argv, {}))
    args = training_arguments(settings, WORLD, {"logging_steps": 3, "seed": 7})
    assert set(args) <= {field.name for field in dataclasses.fields(TrainingArguments)}
    assert {key: args[key] for key in WANTED} == {
        "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 8,
        "save_strategy": "steps",
        "save_steps": 5,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "per_device_eval_batch_size": 16,
        "eval_accumulation_steps": 1,
        "dataloader_num_workers": 8,
        "activation_checkpointing": True,
        "use_cpu": True,
        "ddp_backend": "gloo",
        "ddp_timeout": 3,
        "logging_steps": 3,
        "seed": 7,
        "report_to": [],
        "disable_tqdm": False,
    }
    unsaved = training_arguments(resolve_settings(parse_launch(["--dialect", "hf"], {})), 1, {})
    assert (unsaved["save_strategy"], unsaved["eval_strategy"]) == ("no", "no")
