"""Where in the run a failure happened, by its traceback frames: the tables of what each
framework puts on a stack, and `phase_of_frames`.

Apart from the log-line markers and the timeline (`phases`) because frames decide first and
their tables are most of the code: one module to read when a framework is added.

Frames decide first. Each frame is read against tables of the functions (and, where a name is
too common alone, the files) that torch, transformers, accelerate, Lightning, DeepSpeed,
Megatron, Composer, vLLM and SGLang put on a stack, and against its source line (`loss.backward()`).
A frame falls in one of five tiers, and the stack is read innermost first:

1. a *setup* frame (`from_pretrained`, `deepspeed.initialize`, `accelerator.prepare`, the DDP or
   FSDP constructor, vLLM's `profile_run`, Lightning's `model_to_device`, ...) anywhere on the
   stack: setup. It outranks the other loops because setup runs their code: vLLM profiles
   memory by running `execute_model`, icefall scans for OOMs by running training steps.
2. otherwise the innermost *loop* frame: eval (`evaluate`, `evaluation_loop`, `validation_step`),
   generate (`generate`, vLLM's `execute_model`), checkpoint save (`_save_checkpoint`,
   `torch.save`), data loading (`_next_data`, `__getitem__`, anything under torch/utils/data/).
   A `generate` inside `evaluate` is generate; a `_save_checkpoint` inside the training loop is a
   checkpoint save.
3. otherwise the innermost *step part*: forward, backward, optimizer step. A forward inside a
   backward is activation recomputation, so it is the backward; a backward or forward inside an
   optimizer's closure (Lightning runs every training step inside `optimizer_step`) is that.
4. *placement* frames (`Module.to`, `cuda`, `load_state_dict`, `torch.load`, a constructor,
   `load_model`) are setup only when no training frame and no step part is on the stack: the
   same functions run inside a training step too.
5. *training* frames (`training_step`, `train_step`, `_inner_training_loop`, ...) name no phase,
   but say training was under way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from daemon.evidence.records import Phase


class FrameLike(Protocol):
    """A traceback frame as the log scanner reads it."""

    @property
    def path(self) -> str: ...

    @property
    def func(self) -> str: ...

    @property
    def code(self) -> str: ...


class _Tier(Enum):
    SETUP = "setup"
    LOOP = "loop"  # eval, generate, checkpoint save, data loading
    PART = "part"  # forward, backward, optimizer step
    PLACEMENT = "placement"
    TRAINING = "training"


@dataclass(frozen=True)
class _FuncRule:
    """Frames whose function name is `funcs` (whole name), in a file matching `path` if set."""

    tier: _Tier
    phase: Phase
    funcs: re.Pattern[str]
    path: re.Pattern[str] | None = None


def _names(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


_TORCH_DDP = re.compile(r"torch/nn/parallel/distributed\.py")
_TORCH_FSDP = re.compile(r"torch/distributed/(?:fsdp|_composable)/")
_TORCH_MODULE = re.compile(r"torch/nn/modules/module\.py")
_VLLM = re.compile(r"(?:^|/)vllm/")
_SGLANG = re.compile(r"(?:^|/)sglang/")
_LIGHTNING = re.compile(r"(?:^|/)(?:lightning|pytorch_lightning|lightning_fabric)/")
_DEEPSPEED = re.compile(r"(?:^|/)deepspeed/")
_MEGATRON = re.compile(r"(?:^|/)megatron/")
_ACCELERATE = re.compile(r"(?:^|/)accelerate/")
_TRAINER_FILE = re.compile(r"(?:^|/)\w*trainer\w*\.py\Z")

# In the order they are tried: the first rule a frame matches classifies it.
_FUNC_RULES: tuple[_FuncRule, ...] = (
    # --- setup: wherever it is on the stack ---
    _FuncRule(  # transformers (modeling_utils.py, trainer.py, integrations/deepspeed.py), peft
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"from_pretrained|_from_config|from_config|_load_pretrained_model"
            r"|_load_state_dict_into_meta_model|load_state_dict_into_model|_move_model_to_device"
            r"|_wrap_model|create_accelerator_and_postprocess|_load_from_checkpoint"
            r"|_load_best_model|_load_optimizer_and_scheduler|deepspeed_init"
            r"|deepspeed_load_checkpoint|dispatch_model|load_checkpoint_and_dispatch"
            r"|load_checkpoint_in_model|set_module_tensor_to_device"
            r"|set_module_quantized_tensor_to_device|replace_with_bnb_linear|get_peft_model"
            r"|prepare_model_for_kbit_training|resize_token_embeddings"
            r"|scan_pessimistic_batches_for_oom"  # icefall's pre-training OOM scan (sample 047)
            r"|init_process_group|new_group|init_device_mesh|initialize_model_parallel"
            r"|initialize_megatron|setup_model_and_optimizer|model_provider"
        ),
    ),
    _FuncRule(
        _Tier.SETUP,
        Phase.SETUP,
        _names(r"prepare\w*|_prepare_\w+|load_state"),
        _ACCELERATE,
    ),
    _FuncRule(  # DDP's constructor (sample 042), not its forward-time buffer broadcasts
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"__init__|_ddp_init_helper|_sync_module_states|_sync_params_and_buffers"
            r"|_verify_params_across_processes|_verify_param_shape_across_processes"
        ),
        _TORCH_DDP,
    ),
    _FuncRule(
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"__init__|_init_\w+|_auto_wrap|_recursive_wrap|_move_module_to_device"
            r"|_sync_module_params_and_buffers|_materialize_\w+|fully_shard"
        ),
        _TORCH_FSDP,
    ),
    _FuncRule(  # deepspeed.initialize, the engine's and ZeRO optimizers' constructors
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"initialize|__init__|_configure_\w+|_broadcast_model|_post_init_method"
            r"|_convert_to_zero_parameters|_zero_init_param|load_checkpoint|_load_checkpoint"
            r"|init_distributed"
        ),
        _DEEPSPEED,
    ),
    _FuncRule(
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"get_model|_initialize_distributed|load_checkpoint|_load_base_checkpoint"
            r"|get_megatron_optimizer|build_train_valid_test_\w+|_build_train_valid_test_\w+"
            r"|finish_mpu_init|_initialize_affine_weight_\w+|_warmup_jit_function"
        ),
        _MEGATRON,
    ),
    _FuncRule(_Tier.SETUP, Phase.SETUP, _names(r"__init__"), _TRAINER_FILE),  # a Trainer's
    _FuncRule(  # strategy set-up, model placement, configure_model hooks
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"setup|setup_environment|model_to_device|_setup_model\w*|setup_module\w*"
            r"|setup_optimizers|configure_ddp|_call_configure_model|_call_setup_hook"
            r"|configure_model|configure_sharded_model"
        ),
        _LIGHTNING,
    ),
    _FuncRule(  # vLLM's memory profiling, KV-cache allocation, CUDA-graph capture, model load
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"profile_run|_dummy_run|_dummy_sampler_run|determine_num_available_blocks"
            r"|determine_available_memory|_initialize_kv_caches|initialize_cache"
            r"|initialize_kv_cache|_init_cache\w*|_allocate_kv_cache|allocate_kv_cache"
            r"|init_device|load_model|capture_model|capture|_capture_cudagraphs|_init_executor"
            r"|init_worker|from_engine_args|compile_or_warm_up_model|_warm_?up\w*|profile"
        ),
        _VLLM,
    ),
    _FuncRule(
        _Tier.SETUP,
        Phase.SETUP,
        _names(
            r"init_memory_pool|load_model|init_cuda_graphs|capture|init_torch_distributed"
            r"|initialize|init_cublas|init_attention_backend|profile_max_num_token|_init_pools"
        ),
        _SGLANG,
    ),
    # --- the loops a step runs in ---
    _FuncRule(  # vLLM's engine step and model execution (sample 024: run_engine_loop)
        _Tier.LOOP,
        Phase.GENERATE,
        _names(
            r"generate|_run_engine|step|step_async|engine_step\w*|run_engine_loop"
            r"|execute_model\w*|_execute_model\w*|start_worker_execution_loop"
            r"|_process_model_outputs|run_busy_loop|sample|_sample"
        ),
        _VLLM,
    ),
    _FuncRule(
        _Tier.LOOP,
        Phase.GENERATE,
        _names(
            r"event_loop_\w+|run_batch|forward_batch_generation|forward_extend|forward_decode"
            r"|generate_request|process_batch_result"
        ),
        _SGLANG,
    ),
    _FuncRule(  # transformers' GenerationMixin: the decoding strategies
        _Tier.LOOP,
        Phase.GENERATE,
        _names(r"sample|_sample|beam_sample"),
        re.compile(r"transformers/generation/"),
    ),
    _FuncRule(
        _Tier.LOOP,
        Phase.GENERATE,
        _names(
            r"_?generate(?:_(?:until|text|batch|step|sequences|tokens|completions?|responses?))?"
            r"|_?greedy_search|_?beam_search|_?beam_sample|_?contrastive_search"
            r"|_?group_beam_search|_?assisted_decoding|_dola_decoding"
        ),
    ),
    _FuncRule(
        _Tier.LOOP,
        Phase.CHECKPOINT_SAVE,
        _names(  # `_save_checkpoint`, `save_pretrained`, `torch.save`, `fsdp_save_ckpt`
            r"(?!save_for_backward\Z|_maybe_log_save_evaluate\Z)\w*save\w*"
            r"|consolidate_state_dict|full_optim_state_dict"
        ),
    ),
    _FuncRule(
        _Tier.LOOP,
        Phase.DATA_LOADING,
        _names(
            r"__getitem__|__getitems__|default_collate|collate\w*|\w+_collate\w*|_next_data"
            r"|_try_get_data|_get_data|_next_index"
        ),
        re.compile(r"^(?!.*torch/nn/)"),  # ModuleList.__getitem__ loads no data
    ),
    _FuncRule(_Tier.LOOP, Phase.DATA_LOADING, _names(r"\w+"), re.compile(r"torch/utils/data/")),
    _FuncRule(
        _Tier.LOOP,
        Phase.EVAL,
        _names(
            r"_?evaluat\w+|_?eval_\w+|\w+_eval|_?validation_\w+|_?run_validation|do_validation"
            r"|validate_\w*epoch|val_step|_?test_step|_?predict(?:_step|_loop)?"
            r"|prediction_(?:step|loop)|_run_sanity_check"
        ),
    ),
    _FuncRule(_Tier.LOOP, Phase.EVAL, _names(r"validate|test|predict"), _LIGHTNING),
    _FuncRule(_Tier.LOOP, Phase.EVAL, _names(r"validate|test|predict"), _TRAINER_FILE),
    # --- what trains: these name no phase ---
    _FuncRule(
        _Tier.TRAINING,
        Phase.UNKNOWN,
        _names(
            r"forward_backward\w*|train|_train|training_step|_training_step|train_step"
            r"|_train_step|_inner_training_loop|train_one_epoch|train_epoch|_train_epoch"
            r"|train_loop|_train_loop|training_loop|_training_loop|run_training\w*|run_train_iter"
            r"|run_step|train_batch|_train_batch|_train_microbatch(?:es)?|run_training_batch"
            r"|_run_training_batch|training_epoch|fit_loop|_run_stage|advance_training"
        ),
    ),
    # --- the parts of a step ---
    _FuncRule(
        _Tier.PART,
        Phase.OPTIMIZER_STEP,
        _names(
            r"optimizer_step|_optimizer_step|_single_tensor_\w+|_multi_tensor_\w+|_fused_\w+"
            r"|_init_group|_use_grad|_take_model_step|_update_state|step_with_ready_grads"
            r"|initialize_optimizer_states|clip_grad_norm_?|_clip_grads_with_norm_"
            r"|clip_grad_value_|clip_grad_by_total_norm_fp32|unscale_|_unscale_grads_"
        ),
    ),
    _FuncRule(  # torch.optim, accelerate's, Megatron's and DeepSpeed's optimizer wrappers
        _Tier.PART,
        Phase.OPTIMIZER_STEP,
        _names(r"\w+"),
        re.compile(r"/optim/(?!lr_scheduler)|/optimizers?/|optimizers?\w*\.py|grad_scaler\.py"),
    ),
    _FuncRule(_Tier.PART, Phase.OPTIMIZER_STEP, _names(r"step"), _DEEPSPEED),
    _FuncRule(_Tier.PART, Phase.BACKWARD, _names(r"\w*backward\w*")),
    _FuncRule(_Tier.PART, Phase.FORWARD, _names(r"\w*forward\w*|_call_impl|_wrapped_call_impl")),
    # --- placement: setup only outside training ---
    _FuncRule(
        _Tier.PLACEMENT,
        Phase.SETUP,
        _names(
            r"to|cuda|xpu|_apply|half|bfloat16|float|type|to_empty|load_state_dict"
            r"|_load_from_state_dict"
        ),
        _TORCH_MODULE,
    ),
    _FuncRule(
        _Tier.PLACEMENT,
        Phase.SETUP,
        _names(r"\w+"),
        re.compile(r"torch/serialization\.py"),
    ),
    _FuncRule(
        _Tier.PLACEMENT,
        Phase.SETUP,
        _names(
            r"__init__|load_model|load_pretrained\w*|load_checkpoint|_load_checkpoint"
            r"|load_weights|build_model|create_model|get_model|init_model|setup_model|setup"
            r"|load_state_dict"
        ),
    ),
)

# The source line printed under a frame: what that frame was calling when it failed.
_CODE_RULES: tuple[tuple[_Tier, Phase, re.Pattern[str]], ...] = (
    (
        _Tier.SETUP,
        Phase.SETUP,
        re.compile(
            r"\b(?:deepspeed\.initialize|accelerator\.prepare|init_process_group|from_pretrained"
            r"|DistributedDataParallel|FullyShardedDataParallel|fully_shard|DDP|FSDP"
            r"|\w*Trainer)\("  # a Trainer's constructor places the model (sample 050)
        ),
    ),
    (
        _Tier.LOOP,
        Phase.CHECKPOINT_SAVE,
        re.compile(r"\b(?:torch\.save|save_checkpoint|save_pretrained|save_model|save_state)\("),
    ),
    (_Tier.LOOP, Phase.GENERATE, re.compile(r"\.generate\(")),
    (_Tier.LOOP, Phase.EVAL, re.compile(r"\.evaluate\(")),
    (
        _Tier.PART,
        Phase.OPTIMIZER_STEP,
        re.compile(r"\b(?:optimizer|opt|model_engine|engine|accelerator|scaler)\.step\("),
    ),
    (_Tier.PART, Phase.BACKWARD, re.compile(r"\.backward\(")),
    (
        _Tier.PLACEMENT,
        Phase.SETUP,
        re.compile(r"\b(?:load_model|load_checkpoint|load_state_dict|torch\.load)\("),
    ),
)


@dataclass(frozen=True)
class FramePhase:
    """What the frames say: a phase (UNKNOWN when they say none), whether they settle it even
    against log lines (a loop frame, or training under way), and the frame that decided."""

    phase: Phase
    settled: bool
    decided_by: str | None


def phase_of_frames(frames: tuple[FrameLike, ...]) -> FramePhase:
    """The phase the failing stack shows, read innermost first by the order in the module doc."""
    setup: FrameLike | None = None
    loop: tuple[Phase, FrameLike] | None = None
    part: tuple[Phase, FrameLike] | None = None
    placement: FrameLike | None = None
    training = False
    for frame in reversed(frames):
        for tier, phase in _classify(frame):
            if tier is _Tier.SETUP:
                setup = setup or frame
            elif tier is _Tier.LOOP:
                loop = loop or (phase, frame)
            elif tier is _Tier.TRAINING:
                training = True
            elif tier is _Tier.PLACEMENT:
                placement = placement or frame
            elif part is None or (part[0] is Phase.FORWARD and phase is Phase.BACKWARD):
                part = (phase, frame)  # the innermost part; a forward inside a backward recomputes
    if setup is not None:
        return FramePhase(Phase.SETUP, True, _describe_frame(setup))
    if loop is not None:
        return FramePhase(loop[0], True, _describe_frame(loop[1]))
    if part is not None:
        settled = training or part[0] is not Phase.FORWARD
        return FramePhase(part[0], settled, _describe_frame(part[1]))
    if placement is not None and not training:
        return FramePhase(Phase.SETUP, False, _describe_frame(placement))
    return FramePhase(Phase.UNKNOWN, training, None)


def _classify(frame: FrameLike) -> list[tuple[_Tier, Phase]]:
    """The frame's tier by its function (first rule that matches) and by its source line."""
    found: list[tuple[_Tier, Phase]] = []
    path = frame.path.replace("\\", "/")
    for rule in _FUNC_RULES:
        if rule.funcs.fullmatch(frame.func) and (rule.path is None or rule.path.search(path)):
            found.append((rule.tier, rule.phase))
            break
    if frame.code:
        for tier, phase, pattern in _CODE_RULES:
            if pattern.search(frame.code):
                found.append((tier, phase))
                break
    return found


def _describe_frame(frame: FrameLike) -> str:
    """A frame in a traceback's words, for the reasons."""
    where = f'File "{frame.path}", in {frame.func}'
    return f"{where}: {frame.code}" if frame.code else where
