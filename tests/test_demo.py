"""What `make demo` reads out of the real runs' logs: the dead rank's library frames and the
relaunch's own resume lines. The log text is a real run's (job 47 of a demo on the devcluster:
the HF Trainer's rank 1 died of the injected OOM, rank 0 hung in gloo)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DEMO = Path(__file__).resolve().parent.parent / "deploy" / "demo.py"
SITE = "/work/main/.venv/lib/python3.11/site-packages"
DEAD_RANK_TRACEBACK = f"""\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/main/deploy/devcluster/real-train", line 15, in <module>
[rank1]:   File "/work/main/deploy/devcluster/realtrain/hf.py", line 242, in run_hf
[rank1]:   File "{SITE}/transformers/trainer.py", line 1576, in train
[rank1]:   File "{SITE}/transformers/trainer.py", line 1660, in _inner_training_loop
[rank1]:   File "{SITE}/transformers/trainer.py", line 2172, in compute_loss
[rank1]:   File "{SITE}/torch/nn/modules/module.py", line 1778, in _wrapped_call_impl
[rank1]:   File "{SITE}/torch/nn/modules/module.py", line 1789, in _call_impl
[rank1]:   File "{SITE}/torch/nn/parallel/distributed.py", line 1890, in forward
[rank1]:   File "{SITE}/transformers/utils/generic.py", line 1036, in wrapper
[rank1]:   File "{SITE}/transformers/models/gpt2/modeling_gpt2.py", line 698, in forward
[rank1]:   File "/work/main/deploy/devcluster/realtrain/injection.py", line 129, in on_forward
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.54 GiB.
"""
SURVIVOR_TRACEBACK = f"""\
[rank0]: Traceback (most recent call last):
[rank0]:   File "{SITE}/torch/autograd/graph.py", line 979, in _engine_run_backward
[rank0]: RuntimeError: Timed out waiting 120000ms for recv operation to complete
"""


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    """deploy/demo.py is a script, not a package module: loaded from its path (registered, as
    its dataclasses need)."""
    spec = importlib.util.spec_from_file_location("slurm_medic_demo", DEMO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_dead_ranks_frames_are_one_per_library_kind_in_the_logs_order(
    demo: ModuleType,
) -> None:
    log = SURVIVOR_TRACEBACK + DEAD_RANK_TRACEBACK
    assert demo.library_frames(log, 1) == [
        '[rank1]:   File "transformers/trainer.py", line 1576, in train',
        '[rank1]:   File "torch/nn/modules/module.py", line 1778, in _wrapped_call_impl',
        '[rank1]:   File "torch/nn/parallel/distributed.py", line 1890, in forward',
        '[rank1]:   File "transformers/models/gpt2/modeling_gpt2.py", line 698, in forward',
    ]


def test_another_ranks_frames_and_the_runs_own_code_are_left_out(demo: ModuleType) -> None:
    log = DEAD_RANK_TRACEBACK + SURVIVOR_TRACEBACK
    assert demo.library_frames(log, 0) == [
        '[rank0]:   File "torch/autograd/graph.py", line 979, in _engine_run_backward'
    ]
    assert demo.library_frames(log, 2) == []


def test_the_relaunchs_resume_lines_are_kept_once_each(demo: ModuleType) -> None:
    checkpoint = "/var/lib/slurm-medic-demo/ckpt-demo-fragmentation/checkpoint-2"
    log = (
        f"[transformers] Loading model from {checkpoint}.\n"
        f"[transformers] Loading model from {checkpoint}.\n"
        "[transformers] ***** Running training *****\n"
        "[transformers]   Resuming training from checkpoint with epoch 0 and global step 2\n"
        "[transformers]   Resuming training from checkpoint with epoch 0 and global step 2\n"
        "step 3/12 | loss 5.2801 | lr 3.000e-03 | 121 ms/step\n"
    )
    assert demo.resume_lines(log) == [
        f"[transformers] Loading model from {checkpoint}.",
        "[transformers]   Resuming training from checkpoint with epoch 0 and global step 2",
    ]
    dcp = "resumed from checkpoint /var/lib/slurm-medic-demo/ckpt-x/step_6 at step 6"
    assert demo.resume_lines(f"{dcp}\nstep 7/12 | loss 4.8969\n") == [dcp]
