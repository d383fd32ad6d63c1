# ruff: noqa: E501  (the quoted source lines of the tracebacks are data, kept whole)
"""The text a real run prints: progress lines per framework, the OOM traceback, NCCL's watchdog.

Formats were learnt from public logs (tests/data/emulation/ keeps samples and where they
came from); the figures in them are the memory model's. Pure string builders.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from emulation.model import AllocKind, OomEvent, Phase
from emulation.settings import Dialect

EMULATION_BANNER = "[emulated-train] EMULATION: no GPU is used; memory figures are modelled"
SITE = "/usr/local/lib/python3.11/site-packages"


def format_size(nbytes: int) -> str:
    """Sizes the way PyTorch's allocator prints them: bytes, KiB, MiB or GiB, two decimals."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1024**2:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1024**3:
        return f"{nbytes / 1024**2:.2f} MiB"
    return f"{nbytes / 1024**3:.2f} GiB"


def oom_message(event: OomEvent, *, device: int, cotenant_pid: int | None) -> str:
    """The current `torch.OutOfMemoryError` text, one line, with the model's numbers."""
    other = ""
    if event.cotenant and cotenant_pid is not None:
        other = f"Process {cotenant_pid} has {format_size(event.cotenant)} memory in use. "
    return (
        "torch.OutOfMemoryError: CUDA out of memory. "
        f"Tried to allocate {format_size(event.requested)}. "
        f"GPU {device} has a total capacity of {format_size(event.total)} "
        f"of which {format_size(event.free)} is free. "
        f"{other}"
        "Including non-PyTorch memory, this process has "
        f"{format_size(event.process_in_use)} memory in use. "
        f"Of the allocated memory {format_size(event.allocated)} is allocated by PyTorch, "
        f"and {format_size(event.reserved_unallocated)} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
        "See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str
    code: str

    def render(self) -> list[str]:
        return [f'  File "{self.path}", line {self.line}, in {self.function}', f"    {self.code}"]


def _site(path: str, line: int, function: str, code: str) -> Frame:
    return Frame(f"{SITE}/{path}", line, function, code)


_MODULE_CALL = (
    _site(
        "torch/nn/modules/module.py",
        1736,
        "_wrapped_call_impl",
        "return self._call_impl(*args, **kwargs)",
    ),
    _site("torch/nn/modules/module.py", 1747, "_call_impl", "return forward_call(*args, **kwargs)"),
)
_AUTOGRAD = (
    _site("torch/_tensor.py", 581, "backward", "torch.autograd.backward("),
    _site("torch/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
    _site(
        "torch/autograd/graph.py",
        825,
        "_engine_run_backward",
        "return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass",
    ),
)
_ADAM = (
    _site("torch/optim/optimizer.py", 487, "wrapper", "out = func(*args, **kwargs)"),
    _site("torch/optim/optimizer.py", 91, "_use_grad", "ret = func(self, *args, **kwargs)"),
    _site("torch/optim/adam.py", 223, "step", "adam("),
    _site("torch/optim/adam.py", 784, "adam", "func("),
)
_ADAM_STATE = (
    _site("torch/optim/adam.py", 212, "step", "has_complex = self._init_group("),
    _site("torch/optim/adam.py", 160, "_init_group", 'state["exp_avg_sq"] = torch.zeros_like('),
)
_ADAM_UPDATE = (
    _site(
        "torch/optim/adam.py",
        614,
        "_multi_tensor_adam",
        "exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)",
    ),
)

_HF_MODEL = "transformers/models/llama/modeling_llama.py"
_HF_LAYERS = (
    _site(_HF_MODEL, 1190, "forward", "outputs = self.model("),
    *_MODULE_CALL,
    _site(_HF_MODEL, 945, "forward", "layer_outputs = decoder_layer("),
    *_MODULE_CALL,
)
_HF_KIND_FRAMES: dict[AllocKind, tuple[Frame, ...]] = {
    AllocKind.ATTENTION: (
        *_HF_LAYERS,
        _site(_HF_MODEL, 676, "forward", "hidden_states, self_attn_weights = self.self_attn("),
        *_MODULE_CALL,
        _site(_HF_MODEL, 340, "forward", "attn_output, attn_weights = attention_interface("),
        _site(
            _HF_MODEL,
            262,
            "eager_attention_forward",
            "attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling",
        ),
    ),
    AllocKind.LINEAR: (
        *_HF_LAYERS,
        _site(_HF_MODEL, 690, "forward", "hidden_states = self.mlp(hidden_states)"),
        *_MODULE_CALL,
        _site(
            _HF_MODEL,
            226,
            "forward",
            "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
        ),
        *_MODULE_CALL,
        _site(
            "torch/nn/modules/linear.py",
            125,
            "forward",
            "return F.linear(input, self.weight, self.bias)",
        ),
    ),
    AllocKind.LOGITS: (
        _site(
            _HF_MODEL,
            1214,
            "forward",
            "loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)",
        ),
        _site("transformers/loss/loss_utils.py", 36, "ForCausalLMLoss", "logits = logits.float()"),
    ),
}

_MEGATRON_ROOT = "/workspace/Megatron-LM"
_MEGATRON_MODEL = (
    Frame(
        f"{_MEGATRON_ROOT}/megatron/core/distributed/distributed_data_parallel.py",
        305,
        "forward",
        "return self.module(*inputs, **kwargs)",
    ),
    *_MODULE_CALL,
    Frame(
        f"{_MEGATRON_ROOT}/megatron/core/models/gpt/gpt_model.py",
        264,
        "forward",
        "hidden_states = self.decoder(",
    ),
    *_MODULE_CALL,
    Frame(
        f"{_MEGATRON_ROOT}/megatron/core/transformer/transformer_block.py",
        549,
        "forward",
        "hidden_states, context = layer(",
    ),
    *_MODULE_CALL,
)
_MEGATRON_KIND_FRAMES: dict[AllocKind, tuple[Frame, ...]] = {
    AllocKind.ATTENTION: (
        *_MEGATRON_MODEL,
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/transformer/transformer_layer.py",
            303,
            "forward",
            "attention_output_with_bias = self.self_attention(",
        ),
        *_MODULE_CALL,
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/transformer/attention.py",
            408,
            "forward",
            "core_attn_out = self.core_attention(",
        ),
        *_MODULE_CALL,
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/transformer/dot_product_attention.py",
            158,
            "forward",
            "matmul_result = torch.baddbmm(",
        ),
    ),
    AllocKind.LINEAR: (
        *_MEGATRON_MODEL,
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/transformer/transformer_layer.py",
            353,
            "forward",
            "mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output)",
        ),
        *_MODULE_CALL,
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/transformer/mlp.py",
            104,
            "forward",
            "intermediate_parallel, bias_parallel = self.linear_fc1(hidden_states)",
        ),
    ),
    AllocKind.LOGITS: (
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/distributed/distributed_data_parallel.py",
            305,
            "forward",
            "return self.module(*inputs, **kwargs)",
        ),
        *_MODULE_CALL,
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/models/gpt/gpt_model.py",
            301,
            "forward",
            "loss = self.compute_language_model_loss(labels, logits)",
        ),
        Frame(
            f"{_MEGATRON_ROOT}/megatron/core/models/common/language_module/language_module.py",
            60,
            "compute_language_model_loss",
            "loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)",
        ),
    ),
}


def _model_frames(dialect: Dialect, kind: AllocKind) -> tuple[Frame, ...]:
    table = _MEGATRON_KIND_FRAMES if dialect is Dialect.MEGATRON else _HF_KIND_FRAMES
    return table.get(kind, table[AllocKind.LINEAR])


def _optimizer_frames(kind: AllocKind) -> tuple[Frame, ...]:
    return (*_ADAM, *(_ADAM_STATE if kind is AllocKind.ADAM_STATE else _ADAM_UPDATE))


_HF_SCRIPT = "/workspace/run_clm.py"
_TRAINER = "transformers/trainer.py"
_HF_TRAIN = (
    Frame(_HF_SCRIPT, 681, "<module>", "main()"),
    Frame(
        _HF_SCRIPT, 629, "main", "train_result = trainer.train(resume_from_checkpoint=checkpoint)"
    ),
    _site(_TRAINER, 2245, "train", "return inner_training_loop("),
)
_HF_STEP = (
    *_HF_TRAIN,
    _site(
        _TRAINER,
        2560,
        "_inner_training_loop",
        "tr_loss_step = self.training_step(model, inputs, num_items_in_batch)",
    ),
)
_HF_EVAL = (
    *_HF_TRAIN,
    _site(_TRAINER, 2629, "_inner_training_loop", "self._maybe_log_save_evaluate("),
    _site(
        _TRAINER,
        3098,
        "_maybe_log_save_evaluate",
        "metrics = self._evaluate(trial, ignore_keys_for_eval)",
    ),
    _site(_TRAINER, 3052, "_evaluate", "metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)"),
    _site(_TRAINER, 4151, "evaluate", "output = eval_loop("),
)

_MEGATRON_TRAIN = (
    Frame(f"{_MEGATRON_ROOT}/pretrain_gpt.py", 285, "<module>", "pretrain("),
    Frame(
        f"{_MEGATRON_ROOT}/megatron/training/training.py",
        386,
        "pretrain",
        "iteration, num_floating_point_operations_so_far = train(",
    ),
)
_MEGATRON_STEP = (
    *_MEGATRON_TRAIN,
    Frame(
        f"{_MEGATRON_ROOT}/megatron/training/training.py",
        1327,
        "train",
        "train_step(forward_step_func,",
    ),
)
_MEGATRON_SCHEDULE = (
    *_MEGATRON_STEP,
    Frame(
        f"{_MEGATRON_ROOT}/megatron/training/training.py",
        742,
        "train_step",
        "losses_reduced = forward_backward_func(",
    ),
)

_TORCHRUN_SCRIPT = "/workspace/train.py"
_TORCHRUN_TRAIN = (
    Frame(_TORCHRUN_SCRIPT, 214, "<module>", "main()"),
    Frame(
        _TORCHRUN_SCRIPT, 197, "main", "train(model, optimizer, train_loader, eval_loader, args)"
    ),
)
_DDP_FORWARD = (
    *_MODULE_CALL,
    _site(
        "torch/nn/parallel/distributed.py",
        1643,
        "forward",
        "else self._run_ddp_forward(*inputs, **kwargs)",
    ),
    _site(
        "torch/nn/parallel/distributed.py",
        1459,
        "_run_ddp_forward",
        "return self.module(*inputs, **kwargs)  # type: ignore[index]",
    ),
    *_MODULE_CALL,
)


def _hf_frames(phase: Phase, kind: AllocKind) -> tuple[Frame, ...]:
    if phase is Phase.FORWARD:
        return (
            *_HF_STEP,
            _site(
                _TRAINER,
                3728,
                "training_step",
                "loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)",
            ),
            _site(_TRAINER, 3793, "compute_loss", "outputs = model(**inputs)"),
            *_DDP_FORWARD,
            *_model_frames(Dialect.HF, kind),
        )
    if phase is Phase.BACKWARD:
        return (
            *_HF_STEP,
            _site(_TRAINER, 3766, "training_step", "self.accelerator.backward(loss, **kwargs)"),
            _site("accelerate/accelerator.py", 2454, "backward", "loss.backward(**kwargs)"),
            *_AUTOGRAD,
        )
    if phase is Phase.OPTIMIZER:
        return (
            *_HF_TRAIN,
            _site(_TRAINER, 2612, "_inner_training_loop", "self.optimizer.step()"),
            _site("accelerate/optimizer.py", 171, "step", "self.optimizer.step(closure)"),
            _site(
                "torch/optim/lr_scheduler.py",
                137,
                "wrapper",
                "return func.__get__(opt, opt.__class__)(*args, **kwargs)",
            ),
            *_optimizer_frames(kind),
        )
    if phase is Phase.EVAL:
        if kind is AllocKind.EVAL_GATHER:
            return (
                *_HF_EVAL,
                _site(_TRAINER, 4368, "evaluation_loop", "all_preds.add(logits)"),
                _site(
                    "transformers/trainer_pt_utils.py",
                    305,
                    "add",
                    "self.tensors = nested_concat(self.tensors, tensors, padding_index=self.padding_index)",
                ),
                _site(
                    "transformers/trainer_pt_utils.py",
                    125,
                    "nested_concat",
                    "return torch_pad_and_concatenate(tensors, new_tensors, padding_index=padding_index)",
                ),
                _site(
                    "transformers/trainer_pt_utils.py",
                    84,
                    "torch_pad_and_concatenate",
                    "return torch.cat((tensor1, tensor2), dim=0)",
                ),
            )
        return (
            *_HF_EVAL,
            _site(
                _TRAINER,
                4343,
                "evaluation_loop",
                "losses, logits, labels = self.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)",
            ),
            _site(
                "transformers/trainer_seq2seq.py",
                331,
                "prediction_step",
                "generated_tokens = self.model.generate(**generation_inputs, **gen_kwargs)",
            ),
            _site(
                "torch/utils/_contextlib.py",
                116,
                "decorate_context",
                "return func(*args, **kwargs)",
            ),
            _site("transformers/generation/utils.py", 2465, "generate", "result = self._sample("),
            _site(
                "transformers/generation/utils.py",
                3431,
                "_sample",
                "outputs = self(**model_inputs, return_dict=True)",
            ),
            *_MODULE_CALL,
            *_model_frames(Dialect.HF, kind),
        )
    return (
        Frame(_HF_SCRIPT, 681, "<module>", "main()"),
        Frame(_HF_SCRIPT, 612, "main", "trainer = Trainer("),
        _site(_TRAINER, 614, "__init__", "self._move_model_to_device(model, args.device)"),
        _site(_TRAINER, 901, "_move_model_to_device", "model = model.to(device)"),
        _site("torch/nn/modules/module.py", 1343, "to", "return self._apply(convert)"),
        _site("torch/nn/modules/module.py", 1329, "convert", "return t.to("),
    )


def _megatron_frames(phase: Phase, kind: AllocKind) -> tuple[Frame, ...]:
    schedules = f"{_MEGATRON_ROOT}/megatron/core/pipeline_parallel/schedules.py"
    if phase in (Phase.FORWARD, Phase.EVAL):
        head: tuple[Frame, ...] = _MEGATRON_SCHEDULE
        if phase is Phase.EVAL:
            head = (
                *_MEGATRON_TRAIN,
                Frame(
                    f"{_MEGATRON_ROOT}/megatron/training/training.py",
                    1436,
                    "train",
                    "evaluate_and_print_results(prefix, forward_step_func,",
                ),
                Frame(
                    f"{_MEGATRON_ROOT}/megatron/training/training.py",
                    1623,
                    "evaluate_and_print_results",
                    "total_loss_dict, collected_non_loss_data, timelimit = evaluate(",
                ),
                Frame(
                    f"{_MEGATRON_ROOT}/megatron/training/training.py",
                    1547,
                    "evaluate",
                    "loss_dicts = forward_backward_func(",
                ),
            )
        return (
            *head,
            Frame(
                schedules,
                451,
                "forward_backward_no_pipelining",
                "output_tensor, num_tokens = forward_step(",
            ),
            Frame(
                schedules,
                275,
                "forward_step",
                "output_tensor, loss_func = forward_step_func(data_iterator, model)",
            ),
            Frame(
                f"{_MEGATRON_ROOT}/pretrain_gpt.py",
                204,
                "forward_step",
                "output_tensor = model(tokens, position_ids, attention_mask,",
            ),
            *_MODULE_CALL,
            *_model_frames(Dialect.MEGATRON, kind),
        )
    if phase is Phase.BACKWARD:
        return (
            *_MEGATRON_SCHEDULE,
            Frame(
                schedules,
                470,
                "forward_backward_no_pipelining",
                "backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)",
            ),
            Frame(
                schedules,
                366,
                "backward_step",
                "torch.autograd.backward(output_tensor[0], grad_tensors=output_tensor_grad[0])",
            ),
            _site("torch/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
            _AUTOGRAD[-1],
        )
    if phase is Phase.OPTIMIZER:
        optimizer = f"{_MEGATRON_ROOT}/megatron/core/optimizer/optimizer.py"
        return (
            *_MEGATRON_STEP,
            Frame(
                f"{_MEGATRON_ROOT}/megatron/training/training.py",
                780,
                "train_step",
                "update_successful, grad_norm, num_zeros_in_grad = optimizer.step()",
            ),
            _site(
                "torch/utils/_contextlib.py",
                116,
                "decorate_context",
                "return func(*args, **kwargs)",
            ),
            Frame(optimizer, 484, "step", "success = self.step_with_ready_grads()"),
            _site(
                "torch/utils/_contextlib.py",
                116,
                "decorate_context",
                "return func(*args, **kwargs)",
            ),
            Frame(optimizer, 441, "step_with_ready_grads", "self.optimizer.step()"),
            *_optimizer_frames(kind),
        )
    return (
        *_MEGATRON_TRAIN[:1],
        Frame(
            f"{_MEGATRON_ROOT}/megatron/training/training.py",
            337,
            "pretrain",
            "model, optimizer, opt_param_scheduler = setup_model_and_optimizer(",
        ),
        Frame(
            f"{_MEGATRON_ROOT}/megatron/training/training.py",
            1015,
            "get_model",
            "model_module.cuda(torch.cuda.current_device())",
        ),
        _site(
            "torch/nn/modules/module.py",
            1053,
            "cuda",
            "return self._apply(lambda t: t.cuda(device))",
        ),
    )


def _torchrun_frames(phase: Phase, kind: AllocKind) -> tuple[Frame, ...]:
    if phase is Phase.FORWARD:
        return (
            *_TORCHRUN_TRAIN,
            Frame(_TORCHRUN_SCRIPT, 121, "train", "outputs = model(**batch)"),
            *_DDP_FORWARD,
            *_model_frames(Dialect.TORCHRUN, kind),
        )
    if phase is Phase.BACKWARD:
        return (
            *_TORCHRUN_TRAIN,
            Frame(_TORCHRUN_SCRIPT, 124, "train", "loss.backward()"),
            *_AUTOGRAD,
        )
    if phase is Phase.OPTIMIZER:
        return (
            *_TORCHRUN_TRAIN,
            Frame(_TORCHRUN_SCRIPT, 128, "train", "optimizer.step()"),
            *_optimizer_frames(kind),
        )
    if phase is Phase.EVAL:
        return (
            *_TORCHRUN_TRAIN,
            Frame(_TORCHRUN_SCRIPT, 139, "train", "metrics = evaluate(model, eval_loader, args)"),
            Frame(
                _TORCHRUN_SCRIPT,
                88,
                "evaluate",
                "generated = model.module.generate(**batch, max_new_tokens=args.max_new_tokens)",
            ),
            _site(
                "torch/utils/_contextlib.py",
                116,
                "decorate_context",
                "return func(*args, **kwargs)",
            ),
            _site("transformers/generation/utils.py", 2465, "generate", "result = self._sample("),
            *_model_frames(Dialect.TORCHRUN, kind),
        )
    return (
        Frame(_TORCHRUN_SCRIPT, 214, "<module>", "main()"),
        Frame(_TORCHRUN_SCRIPT, 181, "main", "model = build_model(args).to(device)"),
        _site("torch/nn/modules/module.py", 1343, "to", "return self._apply(convert)"),
    )


def traceback_frames(dialect: Dialect, phase: Phase, kind: AllocKind) -> tuple[Frame, ...]:
    """The call stack a real run of this framework has when the allocation fails."""
    if dialect is Dialect.MEGATRON:
        return _megatron_frames(phase, kind)
    if dialect is Dialect.TORCHRUN:
        return _torchrun_frames(phase, kind)
    return _hf_frames(phase, kind)


def oom_traceback(
    dialect: Dialect, event: OomEvent, *, rank: int, device: int, cotenant_pid: int | None
) -> list[str]:
    """The failing rank's stderr lines, each prefixed `[rankN]: ` as torch.distributed does."""
    lines = ["Traceback (most recent call last):"]
    for frame in traceback_frames(dialect, event.phase, event.kind):
        lines.extend(frame.render())
    lines.append(oom_message(event, device=device, cotenant_pid=cotenant_pid))
    return [f"[rank{rank}]: {line}" for line in lines]


def _glog_stamp(now: float) -> str:
    local = time.localtime(now)
    nanos = int((now % 1) * 1e9)
    return time.strftime("%m%d %H:%M:%S", local) + f".{nanos:09d}"


def watchdog_lines(
    *, rank: int, seq_num: int, numel: int, timeout_ms: int, ran_ms: int, now: float
) -> list[str]:
    """ProcessGroupNCCL's watchdog report for a collective the dead rank never joined."""
    stamp = _glog_stamp(now)
    work = (
        f"WorkNCCL(SeqNum={seq_num}, OpType=ALLREDUCE, NumelIn={numel}, NumelOut={numel}, "
        f"Timeout(ms)={timeout_ms})"
    )
    return [
        f"[rank{rank}]:[E{stamp} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught "
        f"collective operation timeout: {work} ran for {ran_ms} milliseconds before timing out.",
        f"[rank{rank}]:[E{stamp} ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) "
        f"Rank {rank}] Exception (either an error or timeout) detected by watchdog at work: "
        f"{seq_num}, last enqueued NCCL work: {seq_num}, last completed NCCL work: {seq_num - 1}.",
        f"[rank{rank}]:[E{stamp} ProcessGroupNCCL.cpp:630] [Rank {rank}] To avoid data "
        "inconsistency, we are taking the entire process down.",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
    ]


@dataclass(frozen=True)
class StepReport:
    """One finished step, as the progress line of any framework needs it."""

    step: int
    max_steps: int
    loss: float
    learning_rate: float
    elapsed_s: float
    step_s: float
    global_batch: int
    micro_batch: int


def _clock(seconds: float) -> str:
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


_BAR_PARTS = " ▏▎▍▌▋▊▉█"


def tqdm_line(report: StepReport) -> str:
    """tqdm's redraw of the Trainer's bar: percentage, bar, count, elapsed<remaining, rate."""
    fraction = report.step / report.max_steps
    width = 10
    filled = fraction * width
    full = int(filled)
    bar = "█" * full
    if full < width:
        bar += _BAR_PARTS[int((filled - full) * 8)] + " " * (width - full - 1)
    remaining = (report.max_steps - report.step) * report.step_s
    rate = f"{1 / report.step_s:5.2f}it/s" if report.step_s < 1 else f"{report.step_s:5.2f}s/it"
    return (
        f"{math.floor(fraction * 100):3d}%|{bar}| {report.step}/{report.max_steps} "
        f"[{_clock(report.elapsed_s)}<{_clock(remaining)}, {rate}]"
    )


def hf_log_line(report: StepReport, epoch: float) -> str:
    return (
        f"{{'loss': {report.loss:.4f}, 'grad_norm': 1.4142, "
        f"'learning_rate': {report.learning_rate:.6g}, 'epoch': {epoch:.2f}}}"
    )


def megatron_line(report: StepReport, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    return (
        f" [{stamp}] iteration {report.step:8d}/{report.max_steps:8d} | "
        f"consumed samples: {report.step * report.global_batch:12d} | "
        f"elapsed time per iteration (ms): {report.step_s * 1000:.1f} | "
        f"learning rate: {report.learning_rate:.3E} | "
        f"global batch size: {report.global_batch:5d} | "
        f"lm loss: {report.loss:.6E} | loss scale: 1.0 | grad norm: 1.414 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


def deepspeed_line(report: StepReport, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    millis = int((now % 1) * 1000)
    return (
        f"[{stamp},{millis:03d}] [INFO] [logging.py:128:log_dist] [Rank 0] "
        f"step={report.step}, skipped=0, lr=[{report.learning_rate:.6g}], "
        "mom=[[0.9, 0.999]]"
    )


def torchrun_line(report: StepReport) -> str:
    return (
        f"step {report.step}/{report.max_steps} | loss {report.loss:.4f} | "
        f"lr {report.learning_rate:.3e} | {report.step_s * 1000:.0f} ms/step"
    )


def ignored_note(ignored: Sequence[str]) -> str:
    return "[emulated-train] note: ignoring what the emulation does not model: " + " ".join(ignored)
