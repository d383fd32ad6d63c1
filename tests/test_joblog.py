"""The log scanner on real-shaped logs and on bad input: verdicts or clear errors, no hangs."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.evidence.joblog import LogReadError, scan_log
from daemon.evidence.records import OomFamily, Phase, RootCause

LOGS = Path(__file__).parent / "data" / "logs"
OOM = Path(__file__).parent / "data" / "oom"
FILLER = b"{'loss': 1.2345, 'learning_rate': 1.9e-05, 'epoch': 0.42}\n"


def test_multirank_log_finds_the_first_rank_and_calls_the_rest_a_cascade() -> None:
    found = scan_log(LOGS / "torchrun_multirank_backward_oom.log")
    assert found.rank == 3
    assert found.node == "gpu-02"
    assert found.step == 120
    assert found.phase is Phase.BACKWARD
    assert found.cascade_ranks == (0, 1, 2)
    assert found.oom is not None
    assert found.oom.requested_bytes == 226 * 1024**2
    assert found.frames[-1] == "_engine_run_backward"
    assert found.exit_code == 1
    assert 80214 in found.job_pids
    assert found.traceback_seen


def test_megatron_iteration_and_optimizer_phase() -> None:
    found = scan_log(LOGS / "megatron_optimizer_oom.log")
    assert found.step == 185
    assert found.phase is Phase.OPTIMIZER_STEP
    assert found.node == "gpu-03"


def test_dataloader_kill_is_host_ram_in_data_loading() -> None:
    found = scan_log(LOGS / "dataloader_host_ram.log")
    assert found.oom is not None
    assert found.oom.family is OomFamily.HOST_RAM
    assert found.phase is Phase.DATA_LOADING
    assert found.node == "gpu-04"
    assert found.step == 440


def test_collective_timeouts_alone_are_a_cascade_without_root() -> None:
    found = scan_log(LOGS / "nccl_timeout_only.log")
    assert found.oom is None
    assert found.root_cause is RootCause.COLLECTIVE_TIMEOUT
    assert found.rank is None  # every rank timed out: the one that stalled is not in view
    assert found.cascade_ranks == (0, 1, 2)
    assert "Watchdog caught collective operation timeout" in (found.root_failure_line or "")
    assert any(note.startswith("only collective") for note in found.notes)


def test_torchrun_table_sigkill_gives_rank_host_and_signal() -> None:
    found = scan_log(OOM / "torchrun_sigkill.txt")
    assert found.rank == 0
    assert found.exit_code == -9
    assert found.killed_by_signal == 9
    assert found.node is not None
    assert found.node.endswith("-worker")


def test_step_pattern_is_configurable() -> None:
    stream = io.BytesIO(
        b"train it=41 loss=2\ntrain it=42 loss=2\nRuntimeError: CUDA error: out of memory\n"
    )
    assert scan_log(stream, step_pattern=r"it=(\d+)").step == 42
    with pytest.raises(ValueError, match="group"):
        scan_log(io.BytesIO(b"x\n"), step_pattern=r"it=\d+")


def test_small_blocks_give_the_same_answer(tmp_path: Path) -> None:
    path = tmp_path / "job.log"
    path.write_bytes(FILLER * 3000 + (LOGS / "torchrun_multirank_backward_oom.log").read_bytes())
    whole = scan_log(path)
    small = scan_log(path, block_size=4096)
    assert (small.rank, small.node, small.step, small.phase, small.oom) == (
        whole.rank,
        whole.node,
        whole.step,
        whole.phase,
        whole.oom,
    )


def test_failure_far_from_the_end_is_found_past_quiet_filler(tmp_path: Path) -> None:
    path = tmp_path / "job.log"
    failure = (OOM / "torch21_capacty.txt").read_bytes()
    path.write_bytes(FILLER * 1000 + failure + FILLER * 200_000)  # ~12 MB after the failure
    found = scan_log(path)
    assert found.oom is not None
    assert found.oom.requested_bytes == 3 * 1024**3


def test_byte_budget_stops_the_scan_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "job.log"
    path.write_bytes((OOM / "cuda_runtime.txt").read_bytes() + FILLER * 100_000)
    found = scan_log(path, byte_budget=1024 * 1024)
    assert found.oom is None
    assert any("byte budget" in note for note in found.notes)
    assert found.bytes_scanned <= 1024 * 1024 + 1024 * 1024


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.log"
    path.write_bytes(b"")
    found = scan_log(path)
    assert found.root_failure_line is None
    assert found.notes == ("the log is empty",)


def test_binary_garbage_is_noted_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "garbage.log"
    path.write_bytes(bytes(range(256)) * 8192 + os.urandom(1 << 20))
    found = scan_log(path)
    assert found.oom is None
    assert any("binary" in note or "UTF-8" in note for note in found.notes)


def test_invalid_utf8_around_the_message_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "bad.log"
    message = (OOM / "torch22_expandable.txt").read_bytes()
    path.write_bytes(b"\xff\xfe\xc3(garbage\n" + b"[rank2]: \xe2\x82" + message)
    found = scan_log(path)
    assert found.rank == 2
    assert found.oom is not None
    assert found.oom.requested_bytes == 22 * 1024**2
    assert any("UTF-8" in note for note in found.notes)


def test_ten_megabyte_single_line_is_cut_not_swallowed(tmp_path: Path) -> None:
    path = tmp_path / "one-line.log"
    redraws = b"".join(b"\r 12%%| %d/1000 [00:01<00:02]" % step for step in range(400_000))
    assert len(redraws) > 10 * 1024 * 1024
    path.write_bytes(redraws + b"\n" + (OOM / "cuda_runtime.txt").read_bytes())
    found = scan_log(path)
    assert found.oom is not None
    assert found.oom.family is OomFamily.CUDA_RUNTIME
    assert found.step == 399_999
    assert any("cut" in note for note in found.notes)


def test_single_huge_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "no-newline.log"
    path.write_bytes(b"x" * (12 * 1024 * 1024) + b" RuntimeError: CUDA error: out of memory")
    found = scan_log(path)
    assert found.oom is not None
    assert found.oom.family is OomFamily.CUDA_RUNTIME


def test_message_cut_in_the_middle_of_a_number(tmp_path: Path) -> None:
    path = tmp_path / "cut.log"
    path.write_bytes(b"step 7\nRuntimeError: CUDA out of memory. Tried to allocate 2.8")
    found = scan_log(path)
    assert found.oom is not None
    assert found.oom.requested_bytes is None
    assert found.step == 7


def test_partial_last_line_and_ansi_colours(tmp_path: Path) -> None:
    path = tmp_path / "colour.log"
    path.write_bytes(
        b"\x1b[32m 5%|#   | 5/100 [00:01<00:19]\x1b[0m\n"
        b"\x1b[31m[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB."
    )
    found = scan_log(path)
    assert found.rank == 1
    assert found.step == 5
    assert found.oom is not None
    assert found.oom.requested_bytes == 1024**3


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            scan_log(fifo)
        except LogReadError as error:
            outcome.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "scanning a FIFO blocked"
    assert outcome
    assert "FIFO" in str(outcome[0])


def test_symlink_refused_unless_followed(tmp_path: Path) -> None:
    target = tmp_path / "real.log"
    target.write_bytes((OOM / "cudnn.txt").read_bytes())
    link = tmp_path / "latest.log"
    link.symlink_to(target)
    with pytest.raises(LogReadError, match="symlink"):
        scan_log(link)
    found = scan_log(link, follow_symlinks=True)
    assert found.oom is not None
    assert found.oom.family is OomFamily.CUDNN


def test_directory_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LogReadError, match="directory"):
        scan_log(tmp_path)
    with pytest.raises(LogReadError, match="cannot open"):
        scan_log(tmp_path / "absent.log")


def test_non_seekable_stream_is_refused() -> None:
    read_end, write_end = os.pipe()
    try:
        with os.fdopen(read_end, "rb") as stream, pytest.raises(LogReadError, match="seekable"):
            scan_log(stream)
    finally:
        os.close(write_end)


def test_real_srun_label_log_from_the_local_cluster() -> None:
    found = scan_log(LOGS / "devcluster_srun_label.log")
    assert (found.rank, found.node, found.step, found.exit_code) == (1, "gpu-02", 3, 1)
    assert found.oom is not None
    assert found.oom.requested_bytes == 3 * 1024**3


def test_elastic_error_file_is_read_as_a_whole() -> None:
    found = scan_log(LOGS / "elastic_error_file.json")
    assert found.oom is not None
    assert found.oom.requested_bytes == 40000000005777654
    assert found.oom.free_bytes == round(1464 * 1024**3 / 100)
    assert found.frames[-1] == "z"
    assert found.error_type == "OutOfMemoryError"


def _traceback_log(tmp_path: Path, frames: list[tuple[str, str, str]]) -> Path:
    lines = ["Traceback (most recent call last):"]
    for path, func, code in frames:
        lines += [f'  File "{path}", line 1, in {func}', f"    {code}"]
    lines.append("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.")
    log = tmp_path / "tb.log"
    log.write_text("\n".join(lines) + "\n")
    return log


SITE = "/opt/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    ("frames", "phase"),
    [
        (
            [
                ("train.py", "main", "engine.backward(loss)"),
                (
                    f"{SITE}/deepspeed/runtime/engine.py",
                    "backward",
                    "self.optimizer.backward(loss)",
                ),
                (f"{SITE}/torch/autograd/graph.py", "_engine_run_backward", "return run()"),
                (f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", "reduce_ipg_grads", "x()"),
            ],
            Phase.BACKWARD,
        ),
        (
            [
                ("train.py", "main", "model.load_state_dict(torch.load(path))"),
                (f"{SITE}/torch/serialization.py", "load", "return _load(f)"),
            ],
            Phase.SETUP,  # loading weights before training: not a checkpoint save
        ),
        (
            [
                ("train.py", "main", "trainer.train()"),
                (f"{SITE}/transformers/trainer.py", "_save_checkpoint", "self.save_model(out)"),
                (f"{SITE}/torch/serialization.py", "save", "_save(obj)"),
            ],
            Phase.CHECKPOINT_SAVE,
        ),
        (
            [
                ("train.py", "main", "trainer.evaluate()"),
                (f"{SITE}/transformers/trainer.py", "evaluation_loop", "self.prediction_step()"),
                (f"{SITE}/torch/nn/modules/module.py", "_call_impl", "return forward_call()"),
                ("model.py", "forward", "attn = self.self_attn(x)"),
            ],
            Phase.EVAL,
        ),
        (
            [
                ("pretrain_gpt.py", "train_step", "optimizer.step()"),
                ("megatron/core/optimizer/distrib_optimizer.py", "step_with_ready_grads", "x()"),
            ],
            Phase.OPTIMIZER_STEP,
        ),
    ],
)
def test_phase_from_frames(
    tmp_path: Path, frames: list[tuple[str, str, str]], phase: Phase
) -> None:
    assert scan_log(_traceback_log(tmp_path, frames)).phase is phase


def test_heavy_kernels_are_read_from_the_innermost_frames(tmp_path: Path) -> None:
    frames = [("model.py", "forward", "h = self.attention(x)")] + [
        ("model.py", "forward", "h = self.mlp(h)") for _ in range(6)
    ]
    frames.append((f"{SITE}/torch/nn/modules/linear.py", "forward", "return F.linear(x, w)"))
    found = scan_log(_traceback_log(tmp_path, frames))
    assert found.heavy_kernels == ("cublas_matmul",)


def test_lines_after_a_far_failure_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "nccl.log"
    path.write_bytes(FILLER * 1000 + (OOM / "nccl.txt").read_bytes() + FILLER * 100_000)
    found = scan_log(path)
    assert found.oom is not None
    assert found.oom.family is OomFamily.NCCL
    assert found.oom.requested_bytes == 6291456
    assert found.node == "ng30903"


@given(st.binary(max_size=20_000))
@settings(max_examples=60, deadline=None)
def test_any_bytes_give_findings_not_a_crash(data: bytes) -> None:
    found = scan_log(io.BytesIO(data), block_size=4096)
    assert found.bytes_scanned <= len(data)


SAFE_LINES = st.lists(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 .,=", max_size=120), max_size=300
)


@given(SAFE_LINES, SAFE_LINES, st.integers(min_value=0, max_value=7))
@settings(max_examples=60, deadline=None)
def test_an_oom_anywhere_among_lines_is_found(
    before: list[str], after: list[str], rank: int
) -> None:
    message = (OOM / "torch22_expandable.txt").read_text().strip()
    text = "\n".join([*before, f"[rank{rank}]: {message}", *after]) + "\n"
    found = scan_log(io.BytesIO(text.encode()), block_size=4096)
    assert found.rank == rank
    assert found.oom is not None
    assert found.oom.requested_bytes == 22 * 1024**2


def test_four_rank_srun_log_takes_the_step_the_job_reached_not_the_interleaved_one() -> None:
    # Rank 3's traceback (stderr) reaches the log before rank 0's step lines (stdout): the
    # ranks step together, so rank 3 died at the step the others last logged, 6, not 2.
    found = scan_log(LOGS / "devcluster_true_oom_midrun_4rank.log")
    assert found.rank == 3
    assert found.node == "gpu-02"
    assert found.step == 6
    assert found.max_step_seen == 6
    assert found.oom is not None


def test_resumed_run_that_died_before_a_step_is_at_its_resume_step() -> None:
    found = scan_log(LOGS / "devcluster_true_oom_midrun_resumed.log")
    assert found.rank == 3
    assert found.step == 6


def test_srun_killed_task_is_the_failing_rank_and_node() -> None:
    found = scan_log(LOGS / "devcluster_host_ram_4rank.log")
    assert found.oom is not None
    assert found.oom.family is OomFamily.HOST_RAM
    assert found.rank == 3
    assert found.node == "gpu-04"
    assert found.killed_by_signal == 9
