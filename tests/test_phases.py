"""The phase: from the failing stack's frames (each framework's), and from the log's lines."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

from daemon.evidence.frame_phases import phase_of_frames
from daemon.evidence.joblog import scan_log
from daemon.evidence.phases import (
    STALE_AFTER_SECONDS,
    PhaseTimeline,
    clock_seconds,
    decide_phase,
    line_marker,
)
from daemon.evidence.records import Phase
from tests.corpus import LOGS_DIR

SITE = "/opt/conda/lib/python3.10/site-packages"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


@dataclass(frozen=True)
class Frame:
    path: str
    func: str
    code: str = ""


def phase(*frames: tuple[str, str] | tuple[str, str, str]) -> Phase:
    return phase_of_frames(tuple(Frame(*frame) for frame in frames)).phase


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ("003-colossalai-torchrun-sigterm-then-sigkill-rank3.log", Phase.SETUP),  # init line
        ("004-chatglm2-torchrun-sigkill-loading-shards.log", Phase.SETUP),  # shards bar
        ("019-composer-launcher-rank1-crashed-exit1.log", Phase.SETUP),  # `Initializing`
        ("020-mae-launch-dataloader-worker-killed.log", Phase.DATA_LOADING),
        ("023-megatron-nccl-init-bus-error-signal7.log", Phase.SETUP),  # NCCL INFO set-up
        ("024-vllm-engine-loop-oom-error-prefix.log", Phase.GENERATE),  # run_engine_loop
        ("030-accelerate-slurm-hostrank-prefix-forward-oom.log", Phase.FORWARD),
        (
            "039-accelerate-two-unprefixed-tracebacks-unspecified-launch-failure.log",
            Phase.OPTIMIZER_STEP,
        ),
        ("040-mmedit-oom-elastic-worker-group-restart.log", Phase.FORWARD),
        ("045-llama-torch21-bracket-timestamp-sigkill-at-load.log", Phase.SETUP),
        ("046-detectron2-bold-markdown-oom-backward-iterations.log", Phase.BACKWARD),
        ("047-icefall-oom-message-wrapped-and-truncated.log", Phase.SETUP),  # sanity check
        ("048-lcnn-oom-glued-tensorboard-sigterm.log", Phase.FORWARD),  # conv2d_forward
        ("049-llamafactory-unprefixed-oom-gpu4-then-rank5-traceback-load-model.log", Phase.SETUP),
        ("050-llamafactory-rm-oom-five-processes-on-gpu0-setup.log", Phase.SETUP),  # Trainer(
        ("055-visfly-backward-oom-trailing-backtick.log", Phase.BACKWARD),
    ],
)
def test_real_sample_phase(sample: str, expected: Phase) -> None:
    found = scan_log(LOGS_DIR / sample)
    assert found.phase is expected
    assert found.phase_line is not None


def test_real_sample_with_no_phase_in_view_claims_none() -> None:
    # sample 010: DeepSpeed's init lines, then 17 minutes of silence before the kill
    found = scan_log(LOGS_DIR / "010-deepspeed-launcher-return-code-minus11-glued.log")
    assert (found.phase, found.phase_line) == (Phase.UNKNOWN, None)


def test_setup_outranks_the_forward_it_runs() -> None:
    # vllm-project/vllm#7854: memory profiling runs the model
    assert (
        phase(
            (f"{SITE}/vllm/engine/llm_engine.py", "_initialize_kv_caches"),
            (f"{SITE}/vllm/worker/worker.py", "determine_num_available_blocks"),
            (f"{SITE}/vllm/worker/model_runner.py", "profile_run"),
            (f"{SITE}/vllm/worker/model_runner.py", "execute_model"),
            (f"{SITE}/torch/nn/modules/module.py", "_call_impl"),
            (f"{SITE}/vllm/model_executor/models/llama.py", "forward"),
        )
        is Phase.SETUP
    )


def test_deepspeed_initialize_is_setup_even_inside_a_training_function() -> None:
    # deepspeedai/DeepSpeed#6737 (`train` -> deepspeed.initialize -> module.to) and #237 (ZeRO's
    # optimizer states allocated in its constructor)
    assert (
        phase(
            ("main_new.py", "train", "deepspeed.initialize(args=args, model=combined_model,"),
            (f"{SITE}/deepspeed/__init__.py", "initialize"),
            (f"{SITE}/deepspeed/runtime/engine.py", "__init__"),
            (f"{SITE}/deepspeed/runtime/engine.py", "_configure_distributed_model"),
            (f"{SITE}/torch/nn/modules/module.py", "to"),
        )
        is Phase.SETUP
    )
    assert (
        phase(
            (f"{SITE}/deepspeed/pt/deepspeed_light.py", "_configure_zero_optimizer"),
            (f"{SITE}/deepspeed/pt/deepspeed_zero_optimizer.py", "__init__"),
            (f"{SITE}/deepspeed/pt/deepspeed_zero_optimizer.py", "initialize_optimizer_states"),
        )
        is Phase.SETUP
    )


def test_innermost_loop_wins() -> None:
    # transformers' Trainer: a save and an eval both run inside `_maybe_log_save_evaluate`
    # (foundation-model-stack/fms-acceleration#119)
    loop = (f"{SITE}/transformers/trainer.py", "_inner_training_loop")
    wrapper = (f"{SITE}/transformers/trainer.py", "_maybe_log_save_evaluate")
    save = (
        (f"{SITE}/transformers/trainer.py", "_save_checkpoint"),
        (f"{SITE}/transformers/trainer.py", "save_model"),
        (f"{SITE}/transformers/modeling_utils.py", "save_pretrained"),
    )
    assert phase(loop, wrapper, *save) is Phase.CHECKPOINT_SAVE
    evaluate = (
        (f"{SITE}/transformers/trainer.py", "evaluate"),
        (f"{SITE}/transformers/trainer.py", "evaluation_loop"),
        (f"{SITE}/transformers/trainer.py", "prediction_step"),
        (f"{SITE}/torch/nn/modules/module.py", "_call_impl"),
        ("model.py", "forward"),
    )
    assert phase(loop, wrapper, *evaluate) is Phase.EVAL
    generate = (f"{SITE}/transformers/generation/utils.py", "generate")
    assert phase(loop, wrapper, *evaluate[:3], generate, ("model.py", "forward")) is Phase.GENERATE


def test_a_checkpoint_save_by_any_name_is_one() -> None:
    # ByteDance-Seed/Bagel#157: FSDP gathers the full state dict while saving
    assert (
        phase(
            ("pretrain_unified_navit.py", "main", "FSDPCheckpoint.fsdp_save_ckpt("),
            ("train/fsdp_utils.py", "fsdp_save_ckpt", "ema_state_dict = ema_model.state_dict()"),
            (f"{SITE}/torch/nn/modules/module.py", "state_dict"),
            (f"{SITE}/torch/distributed/fsdp/_state_dict_utils.py", "_pre_state_dict_hook"),
        )
        is Phase.CHECKPOINT_SAVE
    )


@pytest.mark.parametrize(
    ("inner", "expected"),
    [
        (
            [("model.py", "training_step"), ("model.py", "forward")],
            Phase.FORWARD,
        ),
        (
            [(f"{SITE}/lightning/pytorch/core/module.py", "manual_backward")],
            Phase.BACKWARD,
        ),
        (
            [(f"{SITE}/torch/optim/adam.py", "_single_tensor_adam")],
            Phase.OPTIMIZER_STEP,
        ),
    ],
)
def test_lightning_runs_each_step_inside_its_optimizer_closure(
    inner: list[tuple[str, str]], expected: Phase
) -> None:
    # Lightning-AI/pytorch-lightning#18059: advance -> _optimizer_step -> optimizer_step -> closure
    outer = (
        (f"{SITE}/pytorch_lightning/loops/training_epoch_loop.py", "advance"),
        (f"{SITE}/pytorch_lightning/loops/optimization/automatic.py", "_optimizer_step"),
        (f"{SITE}/pytorch_lightning/core/module.py", "optimizer_step"),
        (f"{SITE}/pytorch_lightning/core/optimizer.py", "step"),
        (f"{SITE}/pytorch_lightning/loops/optimization/automatic.py", "closure"),
    )
    assert phase(*outer, *inner) is expected


def test_a_forward_inside_a_backward_is_recomputation() -> None:
    assert (
        phase(
            ("train.py", "train_step", "loss.backward()"),
            (f"{SITE}/torch/_tensor.py", "backward"),
            (f"{SITE}/torch/autograd/graph.py", "_engine_run_backward"),
            (f"{SITE}/torch/utils/checkpoint.py", "unpack_hook"),
            (f"{SITE}/torch/utils/checkpoint.py", "recompute_fn"),
            ("model.py", "forward"),
        )
        is Phase.BACKWARD
    )


def test_placement_is_setup_only_outside_training() -> None:
    to = (f"{SITE}/torch/nn/modules/module.py", "to")
    apply = (f"{SITE}/torch/nn/modules/module.py", "_apply")
    assert phase(("train.py", "main", "model.to(device)"), to, apply) is Phase.SETUP
    assert phase(("train.py", "training_step"), ("model.py", "forward"), to, apply) is (
        Phase.FORWARD
    )
    assert phase(("train.py", "train_one_epoch"), to, apply) is Phase.UNKNOWN


def test_data_loading_inside_the_training_loop_and_module_indexing_inside_forward() -> None:
    loop = (f"{SITE}/transformers/trainer.py", "_inner_training_loop")
    fetch = (
        (f"{SITE}/accelerate/data_loader.py", "__iter__"),
        (f"{SITE}/torch/utils/data/dataloader.py", "_next_data"),
        ("dataset.py", "__getitem__"),
    )
    assert phase(loop, *fetch) is Phase.DATA_LOADING
    layers = (f"{SITE}/torch/nn/modules/container.py", "__getitem__")
    assert phase(loop, ("model.py", "forward"), layers) is Phase.FORWARD


def test_a_trainer_constructor_is_setup() -> None:
    # sample 050: the traceback ends inside a Trainer subclass's constructor
    assert (
        phase(
            ("src/llmtuner/train/rm/workflow.py", "run_rm", "trainer = PairwiseTrainer("),
            ("src/llmtuner/train/rm/trainer.py", "__init__", "super().__init__(*args, **kwargs)"),
        )
        is Phase.SETUP
    )


def test_frames_that_show_training_outrank_the_log_lines() -> None:
    eval_line = (Phase.EVAL, "***** Running Evaluation *****")
    forward_only = phase_of_frames((Frame("model.py", "forward"),))
    assert decide_phase(forward_only, eval_line) == eval_line
    backward = phase_of_frames((Frame(f"{SITE}/torch/_tensor.py", "backward"),))
    assert decide_phase(backward, eval_line)[0] is Phase.BACKWARD
    training = phase_of_frames((Frame("train.py", "training_step"),))
    assert decide_phase(training, eval_line) == (Phase.UNKNOWN, None)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("***** Running Evaluation *****", Phase.EVAL),
        (
            "[INFO|trainer.py:3819] 2024-06-01 10:00:00 >> ***** Running Prediction *****",
            Phase.EVAL,
        ),
        ("Saving model checkpoint to out/checkpoint-500", Phase.CHECKPOINT_SAVE),
        (
            " [2024-06-01 10:00:00] saving checkpoint at iteration     500 to ckpt",
            Phase.CHECKPOINT_SAVE,
        ),
        ("[Torch] Checkpoint global_step500 is about to be saved!", Phase.CHECKPOINT_SAVE),
        ("> initializing model parallel with size 1", Phase.SETUP),
        ("Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/8", Phase.SETUP),
        (
            "gpu-01:5283:5699 [7] NCCL INFO Channel 21/0 : 1[101d0] -> 0[101c0] via P2P/IPC/read",
            Phase.SETUP,
        ),
        ("loading weights file model.safetensors from cache", Phase.SETUP),
        (
            "INFO 10-23 19:55:16 model_runner.py:1067] Loading model weights took 19.8557 GB",
            Phase.SETUP,
        ),
        ("***** Running training *****", Phase.UNKNOWN),
        ("{'eval_loss': 0.51, 'eval_runtime': 3.2, 'epoch': 1.0}", Phase.UNKNOWN),
        (" [2024-06-01 10:01:00] successfully saved checkpoint from iteration 500", Phase.UNKNOWN),
    ],
)
def test_log_line_markers(line: str, expected: Phase) -> None:
    marker = line_marker(line)
    assert marker is not None
    assert marker[1] is expected


@pytest.mark.parametrize(
    "line",
    [
        "gpu-01:5283:5699 [7] NCCL INFO comm 0x5581 rank 0 nranks 8 - Abort COMPLETE",
        "Reducer buckets have been rebuilt in this iteration.",
        "{'loss': 1.2, 'grad_norm': 0.8} Saving samples",
    ],
)
def test_lines_that_mark_no_phase_change(line: str) -> None:
    marker = line_marker(line)
    assert marker is None or marker[1] is Phase.UNKNOWN


def test_a_marker_stays_until_training_lines_supersede_it() -> None:
    timeline = PhaseTimeline()
    timeline.mark(10, Phase.CHECKPOINT_SAVE, "Saving model checkpoint to out/checkpoint-500")
    timeline.mark(20, Phase.UNKNOWN, " 50%|█████ | 501/1000 [10:05<10:00]")
    assert timeline.at(15) == (
        Phase.CHECKPOINT_SAVE,
        "Saving model checkpoint to out/checkpoint-500",
    )
    assert timeline.at(25) is None
    assert timeline.at(5) is None


def test_a_marker_older_than_the_stale_limit_by_the_logs_clock_claims_nothing() -> None:
    def at_failure(minutes_later: int) -> tuple[Phase, str] | None:
        timeline = PhaseTimeline()
        timeline.see_clock(0, "[2023-07-10 04:09:42,841] [INFO] [comm.py:652:init_distributed]")
        timeline.mark(0, Phase.SETUP, "Initializing TorchBackend in DeepSpeed with backend nccl")
        later = 4 * 3600 + (9 + minutes_later) * 60 + 42
        clock = f"{later // 3600:02d}:{later % 3600 // 60:02d}:{later % 60:02d}"
        timeline.see_clock(100, f"[2023-07-10 {clock},000] [ERROR] [launch.py:324] exits")
        return timeline.at(100)

    assert STALE_AFTER_SECONDS == 600
    assert at_failure(2) == (
        Phase.SETUP,
        "Initializing TorchBackend in DeepSpeed with backend nccl",
    )
    assert at_failure(17) is None


@pytest.mark.parametrize(
    ("line", "seconds"),
    [
        ("[2023-07-10 04:09:42,841] [INFO] x", 4 * 3600 + 9 * 60 + 42),
        ("E0325 20:57:27.620000 2606 site-packages/torch/api.py:869] failed", 75447),
        ("ERROR 10-11 12:27:29 engine.py:157] Traceback", 44849),
        ("2024-02-27T21:35:32.106313Z fa88a9df || x", 77732),
        ("Epoch 0:   6%|██ | 32040/500150 [16:28:43<94:39:17,  1.37it/s]", None),  # elapsed
        ("no time here", None),
    ],
)
def test_clock_is_read_from_a_lines_time_stamp_only(line: str, seconds: int | None) -> None:
    assert clock_seconds(line) == seconds


def test_a_traceback_printed_after_its_message_decides_the_phase() -> None:
    # samples 030 and 050: stderr printed the OOM message before the traceback
    log = (
        f"[rank2]: {OOM}\n"
        "[rank2]: Traceback (most recent call last):\n"
        '[rank2]:   File "train.py", line 9, in <module>\n'
        "[rank2]:     loss.backward()\n"
        f'[rank2]:   File "{SITE}/torch/_tensor.py", line 522, in backward\n'
        "[rank2]:     torch.autograd.backward(\n"
        f"[rank2]: {OOM}\n"
    )
    found = scan_log(io.BytesIO(log.encode()))
    assert found.rank == 2
    assert found.phase is Phase.BACKWARD
    assert found.frames == ("<module>", "backward")


def test_the_shards_bar_the_failure_is_glued_to_is_setup() -> None:
    log = (
        "Loading checkpoint shards:  57% 4/7 [00:40<00:29,  9.96s/it]Traceback (most recent call"
        f' last):\n  File "train.py", line 3, in <module>\n    main()\n{OOM}\n'
    )
    found = scan_log(io.BytesIO(log.encode()))
    assert found.phase is Phase.SETUP
    assert found.phase_line is not None
    assert found.phase_line.startswith("Loading checkpoint shards")
