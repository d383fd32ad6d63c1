"""Checkpoint discovery and resume on checkpoints the real libraries wrote (issue 14).

tests/test_checkpoints.py builds its trees by hand; here transformers' Trainer and
torch.distributed.checkpoint write them, on CPU, from a tiny model with random weights and
generated tokens. The half-written checkpoints are made for real: a training process is
SIGKILLed while the library is writing, so what is left on disk is what a job that died while
saving leaves. Each layout is also compared with the one the local cluster's emulator writes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from emulation.checkpoints import write_checkpoint
from emulation.settings import Dialect
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from daemon.checkpoints import CheckpointLayout, CheckpointScan, CheckpointSpec, find_last_good

pytestmark = pytest.mark.filterwarnings(
    # DCP without a process group says it assumes one process: that is the path under test.
    "ignore:torch.distributed is disabled:UserWarning"
)

SEQUENCE = 16
# Small enough to train in a blink. The killed run's model is wider in the vocabulary only:
# 12.8M embedding parameters make optimizer.pt ~115 MB, a write long enough to kill inside,
# while a step stays cheap (two thin layers, sixteen tokens).
TINY = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQUENCE)
WIDE = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=50_000, n_positions=SEQUENCE)
# The killed DCP save: one 128 MiB tensor, written and fsynced by DCP before its .metadata.
DCP_KILLED_ELEMENTS = 32 * 1024 * 1024
KILL_ATTEMPTS = 3
SAVE_WAIT_S = 120.0


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Generated token rows, labels equal to inputs (causal LM): no download."""

    def __init__(self, rows: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, vocab_size, (rows, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def model_from(config: GPT2Config, seed: int) -> GPT2LMHeadModel:
    # The config's default bos/eos ids (50256) lie outside a small vocabulary.
    config = GPT2Config(**{**config.to_dict(), "bos_token_id": 0, "eos_token_id": 0})
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def trainer(
    config: GPT2Config,
    output_dir: Path,
    *,
    save_steps: int,
    max_steps: int,
    seed: int = 0,
    callbacks: list[TrainerCallback] | None = None,
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        save_steps=save_steps,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        disable_tqdm=True,
        seed=seed,
    )
    return Trainer(
        model=model_from(config, seed),
        args=args,
        train_dataset=Tokens(64, config.vocab_size),
        callbacks=callbacks,
    )


def hf_spec(root: Path) -> CheckpointSpec:
    return CheckpointSpec(layout=CheckpointLayout.HF, root=str(root))


def dcp_spec(root: Path) -> CheckpointSpec:
    return CheckpointSpec(layout=CheckpointLayout.DCP, root=str(root))


def skipped(scan: CheckpointScan) -> dict[str, str]:
    return {item.name: item.reason for item in scan.skipped}


class WriteOrder:
    """The emulator's order of writes: its `pause` hook is called after each file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: list[str] = []

    def __call__(self) -> None:
        self.files.extend(sorted(set(os.listdir(self.directory)) - set(self.files)))


def train_as_rank(rank: int, port: int, output_dir: str, dcp_checkpoint: str) -> None:
    """One of two ranks (spawned): a Trainer run on gloo, then a DCP save of its model."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    run = trainer(TINY, Path(output_dir), save_steps=2, max_steps=4)
    run.train()
    assert dist.is_initialized()
    assert dist.get_world_size() == 2
    assert run.model is not None
    dcp_save({"model": run.model.state_dict()}, checkpoint_id=dcp_checkpoint)
    # Both leave together: a rank whose peer exits while gloo still holds the pair aborts
    # ("terminate called without an active exception", exit -6).
    dist.barrier()
    Path(output_dir).parent.joinpath(f"done-rank{rank}").touch()
    dist.destroy_process_group()


def train_wide_until_killed(output_dir: str) -> None:
    """The job that is killed while saving checkpoint-2 (runs in a spawned process)."""
    trainer(WIDE, Path(output_dir), save_steps=1, max_steps=50).train()


def save_dcp_until_killed(checkpoint: str, store: str) -> None:
    """A one-process gloo group saving a large tensor, killed before .metadata (spawned)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    dcp_save({"model": {"table": torch.ones(DCP_KILLED_ELEMENTS)}}, checkpoint_id=checkpoint)


def kill_while_saving(
    job: Callable[..., None],
    args: tuple[str, ...],
    checkpoint: Path,
    *,
    writing: str,
    completing: str,
) -> bool:
    """Run `job` in a fresh process and SIGKILL it as soon as `checkpoint/writing` exists.

    True when the kill landed inside the save (`completing` never appeared); False when the
    library finished between the poll and the kill, and the caller tries again.
    """
    process = multiprocessing.get_context("spawn").Process(target=job, args=args)
    process.start()
    deadline = time.monotonic() + SAVE_WAIT_S
    try:
        while not (checkpoint / writing).exists():
            if not process.is_alive():
                pytest.fail(f"{job.__name__} ended (exit {process.exitcode}) before saving")
            if time.monotonic() > deadline:
                pytest.fail(f"{job.__name__} did not start {writing} in {SAVE_WAIT_S:.0f} s")
            time.sleep(0.001)
    finally:
        process.kill()
        process.join()
    assert process.exitcode == -9  # SIGKILL ended it, not the job itself
    return not (checkpoint / completing).exists()


def killed_run(
    base: Path,
    make: Callable[[Path], tuple[Callable[..., None], tuple[str, ...], Path]],
    *,
    writing: str,
    completing: str,
) -> Path:
    """A fresh root per attempt, `make` giving the job, its arguments and the doomed save."""
    for attempt in range(KILL_ATTEMPTS):
        root = base / f"attempt-{attempt}"
        root.mkdir(parents=True)
        job, args, checkpoint = make(root)
        if kill_while_saving(job, args, checkpoint, writing=writing, completing=completing):
            return root
    pytest.fail(f"no kill landed inside the save in {KILL_ATTEMPTS} attempts")


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished Trainer run: checkpoint-2, -4 and -6."""
    output_dir = tmp_path_factory.mktemp("hf-run")
    trainer(TINY, output_dir, save_steps=2, max_steps=6).train()
    return output_dir


@pytest.fixture(scope="module")
def hf_killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Trainer run SIGKILLed while it wrote checkpoint-2's optimizer.pt; checkpoint-1 done."""

    def make(root: Path) -> tuple[Callable[..., None], tuple[str, ...], Path]:
        return train_wide_until_killed, (str(root),), root / "checkpoint-2"

    return killed_run(
        tmp_path_factory.mktemp("hf-killed"),
        make,
        writing="optimizer.pt",
        completing="trainer_state.json",
    )


def test_hf_finder_picks_the_trainers_newest_checkpoint_at_its_global_step(hf_run: Path) -> None:
    scan = find_last_good(hf_spec(hf_run))
    assert scan.found is not None
    assert scan.found.path == hf_run.resolve() / "checkpoint-6"
    assert scan.found.resume_path == str(scan.found.path)
    state = json.loads((scan.found.path / "trainer_state.json").read_text())
    assert scan.found.step == state["global_step"] == 6
    assert [entry["step"] for entry in state["log_history"]][:6] == [1, 2, 3, 4, 5, 6]
    assert scan.skipped == ()


def test_hf_one_process_checkpoint_completes_with_the_file_the_emulator_writes_last(
    hf_run: Path, tmp_path: Path
) -> None:
    real = hf_run / "checkpoint-6"
    real_files = set(os.listdir(real))
    # One process: rng_state.pth; rng_state_<rank>.pth is written only when world_size > 1.
    assert {"trainer_state.json", "model.safetensors", "rng_state.pth"} <= real_files
    assert not any(name.startswith("rng_state_") for name in real_files)
    written = WriteOrder(tmp_path / "checkpoint-6")
    emulated = write_checkpoint(
        Dialect.HF,
        tmp_path,
        step=6,
        max_steps=6,
        world_size=1,
        tensor_parallel=1,
        pipeline_parallel=1,
        pause=written,
    )
    assert written.files[-1] == "trainer_state.json"  # the emulator's completing file is HF's
    emulated_scan = find_last_good(hf_spec(tmp_path))
    assert emulated_scan.found is not None
    assert emulated_scan.found.path == emulated.resolve()
    assert emulated_scan.found.step == 6


@dataclass(frozen=True)
class TwoRanks:
    hf: Path
    dcp: Path


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> TwoRanks:
    """Two processes on a gloo group: checkpoint-2 and -4, then a DCP save in step_4."""
    base = tmp_path_factory.mktemp("two-ranks")
    run = TwoRanks(base / "hf", base / "dcp")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(target=train_as_rank, args=(rank, port, str(run.hf), str(run.dcp / "step_4")))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    done = [base / f"done-rank{rank}" for rank in range(2)]
    deadline = time.monotonic() + SAVE_WAIT_S
    while not all(marker.exists() for marker in done) and time.monotonic() < deadline:
        if any(process.exitcode not in (None, 0) for process in ranks):
            break
        time.sleep(0.2)
    # What is tested is what both ranks wrote; a rank that saved, met its peer at the
    # barrier and then lingers in gloo's teardown on a loaded machine (CI's rank 1 was
    # still alive 120 s after rank 0 exited 0) is stopped, not counted as a failure.
    for process in ranks:
        process.join(5.0)
        process.kill()
        process.join()
    exits = [process.exitcode for process in ranks]
    assert [marker.exists() for marker in done] == [True, True], f"exit codes {exits}"
    assert all(code in (0, -9) for code in exits), f"exit codes {exits}"
    return run


def test_hf_two_ranks_save_an_rng_state_each_and_the_emulator_names_them_alike(
    two_ranks: TwoRanks, tmp_path: Path
) -> None:
    scan = find_last_good(hf_spec(two_ranks.hf))
    assert scan.found is not None
    state = json.loads((scan.found.path / "trainer_state.json").read_text())
    assert scan.found.step == state["global_step"] == 4
    real_files = set(os.listdir(scan.found.path))
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= real_files
    assert "rng_state.pth" not in real_files
    emulated = write_checkpoint(
        Dialect.HF,
        tmp_path,
        step=4,
        max_steps=4,
        world_size=2,
        tensor_parallel=1,
        pipeline_parallel=1,
        pause=lambda: None,
    )
    assert set(os.listdir(emulated)) <= real_files


def test_dcp_two_ranks_write_the_file_names_the_emulator_writes(
    two_ranks: TwoRanks, tmp_path: Path
) -> None:
    scan = find_last_good(dcp_spec(two_ranks.dcp))
    assert scan.found is not None
    assert scan.found.path == two_ranks.dcp.resolve() / "step_4"
    emulated = write_checkpoint(
        Dialect.TORCHRUN,
        tmp_path,
        step=4,
        max_steps=4,
        world_size=2,
        tensor_parallel=1,
        pipeline_parallel=1,
        pause=lambda: None,
    )
    assert set(os.listdir(scan.found.path)) == set(os.listdir(emulated))


def test_hf_checkpoint_killed_while_saving_is_skipped_though_hf_latest_takes_it(
    hf_killed: Path,
) -> None:
    half = hf_killed / "checkpoint-2"
    left = set(os.listdir(half))
    assert {"model.safetensors", "optimizer.pt"} <= left  # weights complete, optimizer cut
    assert "trainer_state.json" not in left
    scan = find_last_good(hf_spec(hf_killed))
    assert scan.found is not None
    assert scan.found.path == hf_killed.resolve() / "checkpoint-1"
    assert scan.found.step == 1
    assert "trainer_state.json" in skipped(scan)["'checkpoint-2'"]
    # Trainer's own resume_from_checkpoint=True would take the half-written one.
    assert get_last_checkpoint(str(hf_killed)) == str(half)  # type: ignore[no-untyped-call]


@dataclass
class Observed:
    global_step_at_begin: int | None = None
    weights_at_begin: dict[str, torch.Tensor] | None = None


class ObserveBegin(TrainerCallback):
    """What the Trainer holds when training starts, after it loaded the checkpoint."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        model = kwargs["model"]
        assert isinstance(model, torch.nn.Module)
        self.observed.global_step_at_begin = state.global_step
        self.observed.weights_at_begin = {
            name: tensor.detach().clone() for name, tensor in model.state_dict().items()
        }


def test_hf_resume_from_the_found_checkpoint_continues_from_its_global_step(
    hf_killed: Path, tmp_path: Path
) -> None:
    relaunch_dir = tmp_path / "relaunch"
    shutil.copytree(hf_killed, relaunch_dir)  # the relaunch writes into the same output dir
    scan = find_last_good(hf_spec(relaunch_dir))
    assert scan.found is not None
    observed = Observed()
    relaunch = trainer(
        WIDE, relaunch_dir, save_steps=1, max_steps=2, seed=7, callbacks=[ObserveBegin(observed)]
    )
    relaunch.train(resume_from_checkpoint=scan.found.resume_path)
    assert observed.global_step_at_begin == scan.found.step == 1
    saved = load_file(str(scan.found.path / "model.safetensors"))
    assert observed.weights_at_begin is not None
    assert all(torch.equal(observed.weights_at_begin[name], saved[name]) for name in saved)
    # The relaunch passed the step it died saving and rewrote checkpoint-2 completely.
    after = find_last_good(hf_spec(relaunch_dir))
    assert after.found is not None
    assert after.found.step == relaunch.state.global_step == 2
    state = json.loads((after.found.path / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]


@dataclass(frozen=True)
class DcpRun:
    root: Path
    saved: dict[int, dict[str, torch.Tensor]]  # step -> model and optimizer tensors, flattened


def flat(tree: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree.detach().clone()
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}/{key}")


def small_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> DcpRun:
    """step_1 and step_2 saved whole (model + AdamW state); step_3 killed before .metadata."""

    def make(root: Path) -> tuple[Callable[..., None], tuple[str, ...], Path]:
        model, optimizer = small_model_and_optimizer(seed=0)
        for step in (1, 2):
            model(torch.randn(5, 8)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optimizer_state}
            dcp_save(state, checkpoint_id=root / f"step_{step}")
            saved[step] = dict(flat(state))
        checkpoint = root / "step_3"
        return save_dcp_until_killed, (str(checkpoint), f"{root}.store"), checkpoint

    saved: dict[int, dict[str, torch.Tensor]] = {}
    root = killed_run(
        tmp_path_factory.mktemp("dcp"), make, writing="__0_0.distcp", completing=".metadata"
    )
    return DcpRun(root, saved)


def test_dcp_finder_picks_the_newest_save_with_metadata_and_skips_the_killed_one(
    dcp_run: DcpRun,
) -> None:
    assert set(os.listdir(dcp_run.root / "step_2")) == {".metadata", "__0_0.distcp"}
    killed = set(os.listdir(dcp_run.root / "step_3"))
    assert "__0_0.distcp" in killed
    assert ".metadata" not in killed
    scan = find_last_good(dcp_spec(dcp_run.root))
    assert scan.found is not None
    assert scan.found.path == dcp_run.root.resolve() / "step_2"
    assert scan.found.step == 2
    assert skipped(scan) == {"'step_3'": "no .metadata marker: the save did not finish"}
    with pytest.raises(CheckpointException, match=r"step_3/\.metadata'"):  # DCP refuses it too
        dcp_load({"model": {"table": torch.zeros(1)}}, checkpoint_id=dcp_run.root / "step_3")


def test_dcp_load_from_the_found_dir_restores_model_and_optimizer(dcp_run: DcpRun) -> None:
    scan = find_last_good(dcp_spec(dcp_run.root))
    assert scan.found is not None
    model, optimizer = small_model_and_optimizer(seed=1)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp_load({"model": model_state, "optim": optimizer_state}, checkpoint_id=scan.found.resume_path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    restored = dict(flat({"model": model_state, "optim": optimizer_state}))
    expected = dcp_run.saved[2]
    assert restored.keys() == expected.keys()
    assert all(torch.equal(restored[name], expected[name]) for name in expected)
    assert not torch.equal(restored["/model/0.weight"], dcp_run.saved[1]["/model/0.weight"])


def test_dcp_one_process_file_names_are_the_emulators(dcp_run: DcpRun, tmp_path: Path) -> None:
    written = WriteOrder(tmp_path / "step_2")
    emulated = write_checkpoint(
        Dialect.TORCHRUN,
        tmp_path,
        step=2,
        max_steps=2,
        world_size=1,
        tensor_parallel=1,
        pipeline_parallel=1,
        pause=written,
    )
    assert set(os.listdir(emulated)) == set(os.listdir(dcp_run.root / "step_2"))
    assert written.files[-1] == ".metadata"


def test_dcp_saved_without_collectives_is_refused_with_its_own_reason(tmp_path: Path) -> None:
    model, _optimizer = small_model_and_optimizer(seed=0)
    dcp_save(
        {"model": model.state_dict()}, checkpoint_id=tmp_path / "step_5", use_collectives=False
    )
    dcp_save({"model": model.state_dict()}, checkpoint_id=tmp_path / "step_4")
    assert set(os.listdir(tmp_path / "step_5")) == {"__0.metadata", "__0_0.distcp"}
    scan = find_last_good(dcp_spec(tmp_path))
    assert scan.found is not None
    assert scan.found.step == 4
    assert "use_collectives=False" in skipped(scan)["'step_5'"]
