"""The training step: every framework's progress line, and the step the failing rank reached."""

from __future__ import annotations

import io

import pytest

from daemon.evidence.joblog import scan_log
from daemon.evidence.records import MAX_STEP, Phase
from daemon.evidence.steps import DEFAULT_STEP_PATTERNS, ProgressTracker, find_step
from tests.corpus import LOGS_DIR, LogLabel, load_log_labels

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
    " capacity of 79.19 GiB of which 1.00 GiB is free."
)
# Held-out sample not read yet (issue 11 follow-up): in 077 the bar `1/935 [...]` is glued to the
# `Traceback` that follows it on one line, and the step is read from neither.
NOT_READ_YET = frozenset({"077-accelerate-deepspeed-tqdm-step1-traceback-glued-oom-in-prose.log"})
STEP_LABELS = [
    label
    for label in load_log_labels()
    if label.step is not None and label.file not in NOT_READ_YET
]


def scan_text(text: str) -> tuple[int | None, str | None]:
    found = scan_log(io.BytesIO(text.encode()), block_size=4096)
    return found.step, found.step_line


@pytest.mark.parametrize("label", STEP_LABELS, ids=lambda label: label.file[:3])
def test_real_sample_step_is_the_labelled_one_from_its_line(label: LogLabel) -> None:
    # 007 Lightning bar, 016 `Epoch: [0][511/1736]`, 026 DLRM's counter glued to `Killed`,
    # 030 the failing rank's own bar among interleaved ones, 037 Megatron `iteration 48/50`,
    # 038 diffusers `Steps:` bar, 046 detectron2's `Overall training speed: 22 iterations`
    found = scan_log(LOGS_DIR / label.file)
    assert found.step == label.step
    assert found.step_line is not None
    assert label.step_line is not None
    assert label.step_line.startswith(found.step_line)


def test_real_loading_shards_bar_is_no_training_step() -> None:
    found = scan_log(LOGS_DIR / "004-chatglm2-torchrun-sigkill-loading-shards.log")
    assert (found.step, found.max_step_seen) == (None, None)


@pytest.mark.parametrize(
    ("line", "step"),
    [
        (" [2025-10-02 12:20:48] iteration       48/      50 | consumed samples:   3072 |", 48),
        ("Epoch: [0][ 511/1736]\t Loss 0.5117", 511),
        ("Epoch(train)  [1][ 50/500]  lr: 1.0e-04  loss: 0.51", 50),
        (" 45%|████▌     | 450/1000 [10:02<12:16,  1.34s/it]", 450),
        ("Epoch 0:   6%|██    | 32040/500150 [6:28:43<94:39:17, global_step=3.2e+4]", 32040),
        ("Steps:  25%|██▌       | 382/1500 [5:29:27<15:48:09, 50.89s/it]", 382),
        ("Epoch 3: 32040it [6:28:43,  1.37it/s, loss=2.6]", 32040),
        ("[epoch=1][batch=16/938]: Train loss/train/total: 0.5", 16),
        ("Epoch [1/10], Step [100/600], Loss: 0.2", 100),
        (
            "[2024-01-01 10:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=1249,"
            " skipped=0, lr=[1e-05]",
            1249,
        ),
        ("{'loss': 1.2, 'learning_rate': 1e-05, 'step': 40}", 40),
        ('{"epoch": 1, "num_updates": "100", "loss": "4.2"}', 100),
        ("[06/09 11:04:25 d2.utils.events]:  eta: 0:10:00  iter: 19  total_loss: 1.2", 19),
        ("iter 100: loss 4.2301, time 95.21ms, mfu 38.50%", 100),
        ("global_step: 95, loss=1.2", 95),
        ("Epoch 0: 100%|█| v_num=95nc, global_step=3.2e+4", 32000),
    ],
)
def test_each_frameworks_progress_line_gives_its_step(line: str, step: int) -> None:
    assert find_step(line, DEFAULT_STEP_PATTERNS) == step


@pytest.mark.parametrize(
    "line",
    [
        "Loading checkpoint shards:  57% 4/7 [00:40<00:29,  9.96s/it]",  # sample 004
        "Validation DataLoader 0:  40%|████      | 2/5 [00:01<00:01,  2.0it/s]",  # Lightning
        "Sanity Checking DataLoader 0:  50%|█████     | 1/2 [00:00<00:00,  2.0it/s]",
        "[Eval batch=3/3] Eval metrics/eval/LanguageCrossEntropy: 0.0154",  # Composer
        "Epoch(val)  [1][ 50/500]  eta: 0:01:00",  # mmengine
        "Map (num_proc=8): 100%|██████████| 1000/1000 [00:01<00:00, 800.00 examples/s]",
        "Processed prompts: 100%|██████████| 64/64 [00:12<00:00,  5.1it/s]",  # vLLM
        "Capturing CUDA graph shapes: 100%|██████████| 35/35 [00:10<00:00,  3.4it/s]",
        "Epoch 3/10",  # an epoch count
        " [2025-10-02 12:20:48] consumed samples:         3072 |",  # a sample count
        "  Num examples = 1000",  # a dataset size
        "  Total optimization steps = 1,000",
        "slurmstepd: error: *** STEP 123.0 ON gpu-01 CANCELLED AT 2024-01-01T00:00:00 ***",
    ],
)
def test_numbers_that_count_no_training_step_are_not_steps(line: str) -> None:
    assert find_step(line, DEFAULT_STEP_PATTERNS) is None


def test_the_last_redraw_of_a_tqdm_line_counts() -> None:
    redraws = "".join(f"\r 12%|#   | {n}/1000 [00:01<00:02]" for n in range(40, 48))
    assert find_step(redraws, DEFAULT_STEP_PATTERNS) == 47


def test_an_eval_bar_redrawn_after_the_training_bar_keeps_the_training_step() -> None:
    line = " 50%|█████ | 500/1000 [10:00<10:00]\rEvaluating:  30%|███ | 3/10 [00:01<00:02]"
    assert find_step(line, DEFAULT_STEP_PATTERNS) == 500


def test_hf_eval_bars_after_the_evaluation_banner_are_not_training_steps() -> None:
    # transformers' eval bar has no words, like its training bar: the banner and the bar's
    # length tell them apart.
    log = (
        " 50%|█████     | 500/1000 [10:00<10:00,  1.20s/it]\n"
        "***** Running Evaluation *****\n"
        "  Num examples = 80\n"
        " 30%|███       | 3/10 [00:01<00:02,  3.00it/s]\n"
        f"{OOM}\n"
    )
    assert scan_text(log)[0] == 500
    found = scan_log(io.BytesIO(log.encode()))
    assert found.phase is Phase.EVAL


def test_training_resumes_after_the_eval_when_the_training_bar_comes_back() -> None:
    log = (
        " 50%|█████     | 500/1000 [10:00<10:00,  1.20s/it]\n"
        "***** Running Evaluation *****\n"
        " 100%|██████████| 10/10 [00:03<00:00,  3.00it/s]\n"
        " 50%|█████     | 501/1000 [10:05<10:00,  1.20s/it]\n"
        f"{OOM}\n"
    )
    found = scan_log(io.BytesIO(log.encode()))
    assert (found.step, found.phase) == (501, Phase.UNKNOWN)


def test_bars_before_the_training_banner_belong_to_data_preparation() -> None:
    log = (
        "100%|██████████| 5000/5000 [00:02<00:00, 2100.00it/s]\n"
        "***** Running training *****\n"
        "  Num examples = 5000\n"
        f"{OOM}\n"
    )
    step, _ = scan_text(log)
    assert step is None


def test_the_failing_ranks_own_bar_counts_among_interleaved_ones() -> None:
    # sample 030's shape: rank 0 reached 7/127, the failing rank 2 never left 0/127, and its
    # bar is printed (closed) after its OOM message.
    log = (
        f"[rank2]: {OOM}\n"
        "[rank0]:   6%|▌         | 7/127 [02:56<15:52,  7.93s/it]\n"
        "[rank2]:   0%|          | 0/127 [04:35<?, ?it/s]\n"
    )
    assert scan_text(log) == (0, "[rank2]:   0%|          | 0/127 [04:35<?, ?it/s]")


def test_the_failing_ranks_last_step_before_its_failure_not_a_later_one_of_another() -> None:
    log = (
        "[rank0]: step 10\n[rank3]: step 10\n[rank3]: step 11\n"
        f"[rank3]: {OOM}\n"
        "[rank0]: step 11\n[rank0]: step 12\n"
    )
    assert scan_text(log)[0] == 11


def test_a_failure_before_any_step_of_an_unranked_log_has_no_step() -> None:
    assert scan_text(f"{OOM}\nstep 5\nstep 6\n")[0] is None


def test_a_configured_pattern_replaces_the_vocabulary() -> None:
    found = scan_log(
        io.BytesIO(f"it=41 | step 7\nit=42\n{OOM}\n".encode()), step_pattern=r"it=(\d+)"
    )
    assert found.step == 42


def test_a_step_beyond_a_signed_64_bit_column_is_dropped_with_a_note() -> None:
    notes: list[str] = []
    tracker = ProgressTracker(DEFAULT_STEP_PATTERNS)
    tracker.read(0, None, f"[Rank 0] step={MAX_STEP + 1}, skipped=0", notes.append)
    assert tracker.max_step() is None
    assert notes == [f"a step beyond 0..{MAX_STEP} was dropped"]


def test_lines_of_a_loop_that_is_not_training_set_the_phase_not_the_step() -> None:
    tracker = ProgressTracker(DEFAULT_STEP_PATTERNS)
    tracker.read(0, None, " 20%|██        | 200/1000 [01:00<04:00,  3.3it/s]")
    tracker.read(10, None, "Loading checkpoint shards:  57% 4/7 [00:40<00:29,  9.96s/it]")
    assert tracker.max_step() == 200
    assert tracker.timeline.current is Phase.SETUP
