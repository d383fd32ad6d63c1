"""Where in the run a failure happened: the phase, from traceback frames and from log lines.

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

Log lines decide when the frames do not: the excerpt has no traceback, or only a forward in
view. The latest marker before the failure counts (`***** Running Evaluation *****`, `Saving
model checkpoint to`, `Loading checkpoint shards`, NCCL's communicator set-up lines), until a
training line (a training step, `***** Running training *****`) supersedes it. A marker older than
`STALE_AFTER_SECONDS` by the clock times the log prints is stale: a run set up minutes before it
died was training in the silence between. Frames that show training (a training frame, a
backward, an optimizer step) outrank every marker.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from daemon.evidence.records import Phase

STALE_AFTER_SECONDS = 10 * 60  # a setup or eval marker this much older than the failure is stale
MAX_PHASE_CHANGES = 10_000  # the timeline keeps its latest changes and clock samples
CLOCK_HEAD_CHARS = 64  # a line's time stamp is printed at its head
CLOCK_STEP_SECONDS = 60  # the clock is sampled when it moves this much: staleness is in minutes
DAY_SECONDS = 24 * 60 * 60


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


# --- log lines ---

_NCCL_INFO = re.compile(r"\bNCCL INFO\b")
# Teardown (`Abort`, `Destroy`), and NCCL's error unwinding (`NCCL INFO group.cc:96 -> 3`: its
# NCCLCHECK macro's `%s:%d -> %d` as an error is returned up the calls), which is no set-up
# (held-out sample 024).
_NCCL_TEARDOWN = re.compile(r"\b(?:Abort|Destroy)|NCCL INFO [\w./\-]{1,256}:[0-9]{1,7} -> [0-9]")

# Each pattern starts at a literal word or a bounded run (`\\*{3}`, never `\\*{3,}`, which costs
# quadratic time on a line of stars), and sees at most `MATCH_CHARS` twice of a line. Each comes
# with the literals (lower case) a line must hold for it to be tried at all.
_LINE_MARKERS: tuple[tuple[Phase, tuple[str, ...], re.Pattern[str]], ...] = (
    # Training goes on: these end an eval, a save or the set-up (UNKNOWN: nothing to claim).
    (
        Phase.UNKNOWN,
        (
            "training",
            "'loss'",
            "train_runtime",
            "'eval_",
            "done with setup",
            "saved checkpoint",
            "validation loss",
        ),
        re.compile(
            r"\*\*\* Running training \*\*\*"  # transformers Trainer's banner
            r"|\{'loss': |'train_runtime': "  # its training log dicts
            r"|'eval_\w+': "  # its eval results: the eval is over
            r"|\b(?:start(?:ing)?|begin(?:ning)?) (?:the )?training\b"
            r"|\btraining (?:started|begins)\b"
            r"|\bdone with setup\b|\bsuccessfully saved checkpoint\b"  # Megatron
            r"|\bvalidation loss at iteration\b",  # Megatron, after its eval
            re.IGNORECASE,
        ),
    ),
    (
        Phase.EVAL,
        ("running evaluation", "running prediction", "evaluating", "running validation"),
        re.compile(
            r"\*\*\* Running (?:evaluation|prediction) \*\*\*"  # transformers Trainer
            r"|\bEvaluating\b|\bRunning validation\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.CHECKPOINT_SAVE,
        ("sav",),
        re.compile(
            r"\bSaving model checkpoint to\b"  # transformers Trainer._save
            r"|\bsav(?:e|ing) (?:the )?(?:model|checkpoint|state|weights)\b"  # Megatron, accelerate
            r"|\bCheckpoint \S{1,200} is about to be saved\b",  # DeepSpeed
            re.IGNORECASE,
        ),
    ),
    (Phase.GENERATE, ("avg prompt throughput",), re.compile(r"\bAvg prompt throughput\b")),
    (
        Phase.SETUP,
        (
            "initiali",
            "store_based_barrier",
            "processes registered",
            "load",
            "sanity check",
            "building",
            "deepspeed",
            "zero stage",
            "gpu blocks",
            "memory profiling",
            "captur",
            "name",
        ),
        re.compile(
            r"\binitiali[sz](?:e[ds]?|ing|ation)\b"  # distributed / model-parallel / engine init
            r"|\bstore_based_barrier_key\b|\bAll distributed processes registered\b"
            r"|\bload(?:ing)? (?:the )?(?:pretrained )?(?:model|checkpoint|weights?|state[ _]dict"
            r"|configuration file|config file|dataset)\b"
            r"|\bsanity check\b"  # icefall's pre-training OOM scan (sample 047)
            r"|\bbuilding\b[^|]{0,40}\b(?:model|datasets?)\b"  # Megatron's `> building ...`
            r"|\bDeepSpeed (?:info|Basic Optimizer|Final Optimizer)\b"
            r"|\bCreating \S{1,40} ZeRO stage\b"
            r"|\bGPU blocks: |\bMemory profiling\b|\bGraph capturing\b"  # vLLM engine start-up
            r"|\bcaptur\w* (?:the model for )?(?:CUDA ?graphs?|cudagraphs?)\b"
            r"|^\s*\|\s*Name\s*\|\s*Type\s*\|\s*Params",  # Lightning's model summary
            re.IGNORECASE,
        ),
    ),
    # The communicator's set-up lines (sample 023), not its teardown (`Abort`, `Destroy`).
    (Phase.SETUP, ("nccl info",), _NCCL_INFO),
)
# A loop's progress bar, by the words before its counter: which loop it is. The first that
# matches wins; a bar none matches is the training loop's (HF Trainer's bar has no words).
_LOOP_WORDS: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (Phase.SETUP, re.compile(r"\bgenerating \w+ split\b", re.IGNORECASE)),  # datasets
    (
        Phase.EVAL,
        re.compile(
            r"\b(?:eval\w*|validat\w*|valid|val|test(?:ing)?|predict\w*|sanity checking"
            r"|inference)\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.GENERATE,
        re.compile(
            r"\b(?:generat\w*|processed prompts|adding requests|sampl(?:e|er|ing)|decod(?:e|ing)"
            r"|rollouts?)\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.SETUP,
        re.compile(
            r"\b(?:load(?:ing)?|download(?:ing)?|fetch(?:ing)?|captur(?:e|ing)|initiali[sz]\w*"
            r"|compil(?:e|ing)|warm(?:ing)?[ -]?up|map|filter(?:ing)?|tokeniz\w*|preprocess\w*"
            r"|convert(?:ing)?|shuffl\w*|packing|grouping|concatenat\w*|resolving|extracting"
            r"|building|creating)\b",
            re.IGNORECASE,
        ),
    ),
    (
        Phase.CHECKPOINT_SAVE,
        re.compile(r"\b(?:sav(?:e|ing)|writ(?:e|ing)|upload\w*)\b", re.IGNORECASE),
    ),
)
# A wall-clock time at a line's head (`[2023-07-10 04:09:42,841]`, `E0325 20:57:27.62`,
# `ERROR 10-11 12:27:29`), never a tqdm elapsed time (`[6:28:43<94:39:17`).
_CLOCK = re.compile(r"(?:(?<=[\sT])|^)([01][0-9]|2[0-3]):([0-5][0-9]):([0-5][0-9])(?![0-9<])")


def line_marker(segment: str) -> tuple[int, Phase] | None:
    """The last phase marker in one line (one `\\r` redraw of it): its position and phase."""
    found: tuple[int, Phase] | None = None
    lowered = segment.lower()
    for phase, gate, pattern in _LINE_MARKERS:
        if not any(literal in lowered for literal in gate):
            continue
        if pattern is _NCCL_INFO and _NCCL_TEARDOWN.search(segment):
            continue
        for match in pattern.finditer(segment):
            if found is None or match.start() > found[0]:
                found = (match.start(), phase)
    return found


def loop_phase(words: str) -> Phase | None:
    """Which loop a progress counter counts, by the words before it; None: the training loop."""
    for phase, pattern in _LOOP_WORDS:
        if pattern.search(words):
            return phase
    return None


def clock_seconds(text: str) -> int | None:
    """The time of day a line's head prints, in seconds; None when it prints none."""
    match = _CLOCK.search(text[:CLOCK_HEAD_CHARS])
    if match is None:
        return None
    hours, minutes, seconds = (int(group) for group in match.groups())
    return hours * 3600 + minutes * 60 + seconds


@dataclass(frozen=True)
class _Change:
    offset: int
    phase: Phase
    line: str
    clock: int | None


@dataclass
class PhaseTimeline:
    """The phase the log lines put the run in, as it changed through the log, and its clock."""

    changes: deque[_Change] = field(default_factory=lambda: deque(maxlen=MAX_PHASE_CHANGES))
    clocks: deque[tuple[int, int]] = field(  # (offset, seconds), sampled
        default_factory=lambda: deque(maxlen=MAX_PHASE_CHANGES)
    )
    clock: int | None = None

    @property
    def current(self) -> Phase:
        return self.changes[-1].phase if self.changes else Phase.UNKNOWN

    def see_clock(self, offset: int, text: str) -> None:
        seconds = clock_seconds(text)
        if seconds is None:
            return
        self.clock = seconds
        last = self.clocks[-1][1] if self.clocks else None
        if last is None or abs(seconds - last) >= CLOCK_STEP_SECONDS:
            self.clocks.append((offset, seconds))

    def mark(self, offset: int, phase: Phase, line: str) -> None:
        """The run entered `phase` at this line (UNKNOWN: back to training)."""
        if phase is self.current and (phase is Phase.UNKNOWN or self.changes[-1].line == line):
            return
        self.changes.append(_Change(offset, phase, line[:1000], self.clock))

    def at(self, offset: int) -> tuple[Phase, str] | None:
        """The phase the lines claim at `offset` (a failure there), or None if they claim none."""
        index = bisect_right([change.offset for change in self.changes], offset) - 1
        if index < 0 or self.changes[index].phase is Phase.UNKNOWN:
            return None
        change = self.changes[index]
        clock_index = bisect_right([at for at, _ in self.clocks], offset) - 1
        now = self.clocks[clock_index][1] if clock_index >= 0 else None
        stale = (
            change.clock is not None
            and now is not None
            and (now - change.clock) % DAY_SECONDS > STALE_AFTER_SECONDS
        )
        return None if stale else (change.phase, change.line)


def decide_phase(frames: FramePhase, line: tuple[Phase, str] | None) -> tuple[Phase, str | None]:
    """Frames that settle it win; then the log line's phase; then a forward or placement frame."""
    if frames.settled or line is None:
        return frames.phase, frames.decided_by
    return line
