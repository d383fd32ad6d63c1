"""The one thing that is not real: the CUDA OOM, raised at the real point of the real step.

The emulator's memory model decides who dies, at which step and phase, and with which
numbers (`emulation.runner.find_failure`); `emulation.messages` renders the message as the
emulator does. Here a hook raises `torch.OutOfMemoryError` with that message from inside the
real module, autograd or optimizer call, so the traceback Python prints carries the real
torch and transformers frames of that phase:

- forward: a forward hook on the module the allocation belongs to (the last block's
  attention or MLP, the LM head for the logits) while the model trains;
- backward: a full backward hook on the last block's MLP (the first one autograd reaches);
- optimizer: an optimizer step pre-hook;
- eval: a forward hook while the model is in eval mode (evaluation or generate);
- setup: a forward pre-hook on the whole model at the first step (on CPU no device copy can
  fail, so the first use of the weights stands in for it).

A dead NCCL rank leaves its peers waiting in the collective until the watchdog's timeout; a
dead gloo peer closes its sockets and the peers fail at once ("Connection closed by peer").
`linger_after_death` keeps the dead rank's process, and so its sockets, alive for a while,
as a run's non-daemon flusher thread does, so the others hang in the real collective until
gloo's own timeout ends them.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from emulation.messages import oom_message
from emulation.model import AllocKind, Phase
from emulation.runner import find_failure
from emulation.settings import Settings
from emulation.topology import NodeFixture, Placement

# `oom_message` renders the whole line Python prints; the exception carries what follows.
_MESSAGE_PREFIX = "torch.OutOfMemoryError: "
LINGER_THREAD_NAME = "metrics-flusher"


@dataclass(frozen=True)
class Injection:
    """The modelled death: this rank, at this step (1-based), in this phase, with this text."""

    rank: int
    step: int
    phase: Phase
    kind: AllocKind
    message: str


def plan_injection(
    settings: Settings,
    placement: Placement,
    fixtures: Mapping[str, NodeFixture],
    start_step: int,
) -> Injection | None:
    """The emulator's verdict for this launch; None when nobody runs out of GPU memory.

    A host-RAM death is no injection: the dataloader workers really allocate, and the
    kernel's cgroup OOM killer does the rest.
    """
    config = settings.train_config(placement.world_size)
    failure = find_failure(config, settings, placement, fixtures, start_step)
    if failure is None or failure.oom is None:
        return None
    device = (
        placement.local_rank
        if placement.rank == failure.rank
        else failure.rank % placement.ranks_per_node
    )
    text = oom_message(failure.oom, device=device, cotenant_pid=failure.cotenant_pid)
    return Injection(
        rank=failure.rank,
        step=failure.step,
        phase=failure.oom.phase,
        kind=failure.oom.kind,
        message=text.removeprefix(_MESSAGE_PREFIX),
    )


def _named(model: torch.nn.Module, suffix: str) -> torch.nn.Module:
    """The last submodule whose name ends in `suffix` (the deepest block of a GPT-2)."""
    found: list[torch.nn.Module] = [
        module for name, module in model.named_modules() if name.endswith(suffix)
    ]
    if not found:
        raise LookupError(f"the model has no submodule named *{suffix}")
    return found[-1]


def _forward_target(model: torch.nn.Module, kind: AllocKind) -> torch.nn.Module:
    if kind is AllocKind.LOGITS:
        return _named(model, "lm_head")
    if kind in (AllocKind.ATTENTION, AllocKind.KV_CACHE):
        return _named(model, ".attn")
    return _named(model, ".mlp")


def arm(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    injection: Injection | None,
    rank: int,
    current_step: Callable[[], int],
) -> None:
    """Register the hook that raises the OOM; a no-op on every rank but the dying one.

    `current_step` returns the 1-based step being run (the one whose progress line comes
    next), so the hook fires at the modelled step and only then.
    """
    if injection is None or injection.rank != rank:
        return

    def fire() -> None:
        raise torch.OutOfMemoryError(injection.message)

    def due(training: bool) -> bool:
        wanted = injection.phase is not Phase.EVAL
        return current_step() == injection.step and training == wanted

    def on_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        if due(module.training):
            fire()

    def on_forward_pre(module: torch.nn.Module, args: Any) -> None:
        if due(module.training):
            fire()

    def on_backward(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        if due(module.training):
            fire()

    def on_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if current_step() == injection.step:
            fire()

    if injection.phase in (Phase.FORWARD, Phase.EVAL):
        _forward_target(model, injection.kind).register_forward_hook(on_forward)
    elif injection.phase is Phase.BACKWARD:
        _named(model, ".mlp").register_full_backward_hook(on_backward)
    elif injection.phase is Phase.OPTIMIZER:
        if optimizer is None:
            raise ValueError("an optimizer-step injection needs the optimizer")
        optimizer.register_step_pre_hook(on_optimizer_step)
    else:
        model.register_forward_pre_hook(on_forward_pre)


def linger_after_death(seconds: float) -> None:
    """Keep this process alive `seconds` after an uncaught exception ends the main thread.

    A non-daemon thread outlives the main thread: Python prints the traceback (through
    torch's `[rankN]: ` hook), then waits for the thread before exiting. A run that ends
    normally (or by sys.exit) exits at once.
    """
    died = threading.Event()
    previous = sys.excepthook

    def record_death(
        kind: type[BaseException], error: BaseException, trace: TracebackType | None
    ) -> None:
        died.set()
        previous(kind, error, trace)

    def hold_sockets_after_death() -> None:
        threading.main_thread().join()
        if died.is_set():
            time.sleep(seconds)

    sys.excepthook = record_death
    threading.Thread(target=hold_sockets_after_death, name=LINGER_THREAD_NAME).start()
