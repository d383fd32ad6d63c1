"""Which flag, override and config key sets which knob: the frameworks' documented names as data.

Names are compared normalised (`--micro-batch-size`, `--micro_batch_size` and
`model.micro_batch_size=` all end in `micro_batch_size`). A name is FRAMEWORK when a launcher
or framework documents it with that meaning (HF TrainingArguments, Megatron-LM, DeepSpeed,
NeMo/Hydra, Composer, torchtune, nanotron, torchtitan, Lightning, accelerate); CONVENTION when
it is only a common name a script's own argparse may mean otherwise (`--batch_size`), so the
report can say how far to trust it and a user mapping can overrule it.

Sources (each table entry is the documented flag/key as written there):
HF `TrainingArguments` (per_device_train_batch_size, gradient_accumulation_steps,
gradient_checkpointing, per_device_eval_batch_size, dataloader_num_workers, output_dir,
deepspeed); TRL (max_seq_length, max_length); Megatron-LM `arguments.py` (--micro-batch-size,
--global-batch-size, --seq-length, --recompute-granularity, --recompute-activations,
--checkpoint-activations, --save, --load, --num-workers); DeepSpeed config
(train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size,
zero_optimization.stage); NeMo (model.micro_batch_size, model.global_batch_size,
model.seq_length, model.activations_checkpoint_method/granularity, trainer.num_nodes,
trainer.devices, trainer.accumulate_grad_batches, exp_manager.exp_dir/explicit_log_dir);
Composer/llm-foundry (device_train_microbatch_size, global_train_batch_size,
device_eval_batch_size, max_seq_len, save_folder, fsdp_config.activation_checkpointing);
torchtune (batch_size, gradient_accumulation_steps, enable_activation_checkpointing,
output_dir); nanotron (tokens.micro_batch_size, tokens.batch_accumulation_per_replica,
tokens.sequence_length, checkpoints.checkpoints_path, parallelism.recompute_layer);
torchtitan (training.batch_size, training.seq_len, activation_checkpoint.mode,
checkpoint.folder); Lightning (trainer.accumulate_grad_batches, ModelCheckpoint dirpath);
accelerate launch (--num_machines, --gradient_accumulation_steps, --zero_stage, --config_file);
LLaMA-Factory (cutoff_len); BioNeMo (--result-dir, --max-seq-length, --num-nodes, --num-gpus).
PyTorch Lightning `Trainer` (--accumulate_grad_batches, --default_root_dir: "default path for
logs and weights when no logger/ckpt_callback passed", so a ModelCheckpoint `dirpath` wins;
`--strategy deepspeed_stage_N[_offload]`, the registered DeepSpeedStrategy names, and the
DeepSpeed config its DeepSpeedStrategy reads from PL_DEEPSPEED_CONFIG_PATH:
lightning/pytorch/strategies/deepspeed.py); LightningCLI's `--trainer.*`/`--data.*`/`--model.*`
flags are dotted paths read by their last component like any override. verl (docs/examples/
config.rst and trainer/config/sft_trainer.yaml: data.micro_batch_size_per_gpu,
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, model.enable_gradient_checkpointing,
trainer.default_local_dir; its data.train_batch_size counts prompts in PPO and samples in SFT,
so it is not read).
Conventions of common argparse training scripts (CONVENTION): timm train.py (--batch-size,
--validation-batch-size, --grad-checkpointing, --grad-accum-steps, --workers); open_clip
params.py (--batch-size, --accum-freq, --grad-checkpointing, --workers); MAE main_pretrain.py
(--accum_iter); diffusers examples (--train_batch_size "per device", --gradient_checkpointing,
--output_dir); Fengshenbang-LM UniversalDataModule / UniversalCheckpoint (--train_batchsize,
--val_batchsize, --valid_batchsize, --test_batchsize, --dataloader_workers, --dirpath,
--save_ckpt_path, --load_ckpt_path). llm.c's single-letter flags (-b, -t, -z, -r, -o) are
not read: a letter means nothing outside its program.

One piece of some 510 lines, nearly all of it the tables themselves: data, not logic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from daemon.importer.records import Basis, Knob
from daemon.importer.values import Text


@dataclass(frozen=True)
class Name:
    knob: Knob
    basis: Basis
    rank: int = 0  # among names of one knob in one place, the lower rank wins
    presence: bool = False  # a flag whose presence alone means "on"
    topology: bool = False  # a launcher's or framework's copy of nodes / GPUs per node
    fallback: bool = False  # used only when no other name of its knob is set: not a copy of it


F, C = Basis.FRAMEWORK, Basis.CONVENTION
K = Knob

NAMES: dict[str, Name] = {
    # micro-batch (per GPU)
    "per_device_train_batch_size": Name(K.MICRO_BATCH, F),
    "micro_batch_size": Name(K.MICRO_BATCH, F),
    "device_train_microbatch_size": Name(K.MICRO_BATCH, F),
    "train_micro_batch_size_per_gpu": Name(K.MICRO_BATCH, F),
    "micro_train_batch_size": Name(K.MICRO_BATCH, F),  # OpenRLHF
    "micro_batch_size_per_gpu": Name(K.MICRO_BATCH, F, rank=1),  # verl data.*
    "batch_size_training": Name(K.MICRO_BATCH, F),  # llama-recipes
    "local_batch_size": Name(K.MICRO_BATCH, F, rank=1),  # torchtitan
    "per_gpu_train_batch_size": Name(K.MICRO_BATCH, F, rank=1),  # HF before 3.0
    "batch_size_per_gpu": Name(K.MICRO_BATCH, C, rank=2),
    "batch_size_per_device": Name(K.MICRO_BATCH, C, rank=2),
    "per_gpu_batch_size": Name(K.MICRO_BATCH, C, rank=2),
    "device_batch_size": Name(K.MICRO_BATCH, C, rank=3),
    "train_batchsize": Name(K.MICRO_BATCH, C, rank=3),  # Fengshenbang
    "batch_size": Name(K.MICRO_BATCH, C, rank=5),
    # gradient accumulation
    "gradient_accumulation_steps": Name(K.GRAD_ACCUM, F),
    "accumulate_grad_batches": Name(K.GRAD_ACCUM, F),
    "batch_accumulation_per_replica": Name(K.GRAD_ACCUM, F),
    "update_freq": Name(K.GRAD_ACCUM, F),  # fairseq
    "grad_accum_steps": Name(K.GRAD_ACCUM, C, rank=2),
    "grad_acc_steps": Name(K.GRAD_ACCUM, C, rank=2),
    "grad_accumulation_steps": Name(K.GRAD_ACCUM, C, rank=2),
    "gradient_accumulate_every": Name(K.GRAD_ACCUM, C, rank=2),
    "accumulate_steps": Name(K.GRAD_ACCUM, C, rank=2),
    "grad_acc": Name(K.GRAD_ACCUM, C, rank=3),
    "grad_accum": Name(K.GRAD_ACCUM, C, rank=2),
    "gradient_accumulation": Name(K.GRAD_ACCUM, C, rank=2),
    "accumulation_steps": Name(K.GRAD_ACCUM, C, rank=2),
    "accum_steps": Name(K.GRAD_ACCUM, C, rank=2),
    "accum": Name(K.GRAD_ACCUM, C, rank=3),
    "accum_freq": Name(K.GRAD_ACCUM, C, rank=2),  # open_clip
    "accum_iter": Name(K.GRAD_ACCUM, C, rank=2),  # MAE
    "accumulate": Name(K.GRAD_ACCUM, C, rank=3),
    # global batch
    "global_batch_size": Name(K.GLOBAL_BATCH, F),
    "global_train_batch_size": Name(K.GLOBAL_BATCH, F),
    "total_batch_size": Name(K.GLOBAL_BATCH, C, rank=2),
    "effective_batch_size": Name(K.GLOBAL_BATCH, C, rank=2),
    # sequence length
    "seq_length": Name(K.SEQ_LEN, F),
    "seq_len": Name(K.SEQ_LEN, F),
    "max_seq_length": Name(K.SEQ_LEN, F),
    "max_seq_len": Name(K.SEQ_LEN, F),
    "sequence_length": Name(K.SEQ_LEN, F),
    "encoder_seq_length": Name(K.SEQ_LEN, F),
    "cutoff_len": Name(K.SEQ_LEN, F),
    "sequence_len": Name(K.SEQ_LEN, F),  # axolotl
    "ctx_len": Name(K.SEQ_LEN, C, rank=3),
    "context_size": Name(K.SEQ_LEN, C, rank=3),
    "max_length": Name(K.SEQ_LEN, C, rank=3),
    "block_size": Name(K.SEQ_LEN, C, rank=3),
    "context_len": Name(K.SEQ_LEN, C, rank=3),
    "context_length": Name(K.SEQ_LEN, C, rank=3),
    "max_context_width": Name(K.SEQ_LEN, C, rank=3),
    "max_len": Name(K.SEQ_LEN, C, rank=4),
    "model_max_length": Name(K.SEQ_LEN, C, rank=5),
    # dataloader workers
    "num_workers": Name(K.WORKERS, F),
    "dataloader_num_workers": Name(K.WORKERS, F),
    "num_loading_workers": Name(K.WORKERS, F),
    "num_workers_dataloader": Name(K.WORKERS, F),  # llama-recipes
    "n_workers": Name(K.WORKERS, C, rank=2),
    "num_data_workers": Name(K.WORKERS, C, rank=2),
    "dataloader_workers": Name(K.WORKERS, C, rank=2),
    "workers": Name(K.WORKERS, C, rank=2),
    # activation recomputation
    "gradient_checkpointing": Name(K.RECOMPUTE, F),
    "recompute_granularity": Name(K.RECOMPUTE, F),
    "activations_checkpoint_granularity": Name(K.RECOMPUTE, F, rank=1),
    "activations_checkpoint_method": Name(K.RECOMPUTE, F, rank=2),
    "recompute_activations": Name(K.RECOMPUTE, F, rank=1, presence=True),
    "checkpoint_activations": Name(K.RECOMPUTE, F, rank=1, presence=True),
    "activation_checkpointing": Name(K.RECOMPUTE, F),
    "enable_activation_checkpointing": Name(K.RECOMPUTE, F),
    "fsdp_activation_checkpointing": Name(K.RECOMPUTE, F),
    "recompute_layer": Name(K.RECOMPUTE, F),
    "use_gradient_checkpointing": Name(K.RECOMPUTE, C, rank=2),
    "use_gradient_checkpoint": Name(K.RECOMPUTE, C, rank=2),
    "gradient_checkpoint": Name(K.RECOMPUTE, C, rank=2),
    "enable_gradient_checkpointing": Name(K.RECOMPUTE, F),  # verl model.*
    "grad_checkpointing": Name(K.RECOMPUTE, C, rank=2, presence=True),  # timm, open_clip
    "grad_ckpt": Name(K.RECOMPUTE, C, rank=2),
    "grad_checkpoint": Name(K.RECOMPUTE, C, rank=2),
    "recompute": Name(K.RECOMPUTE, C, rank=3),
    "activation_checkpoint": Name(K.RECOMPUTE, C, rank=2),
    # ZeRO stage
    "zero_stage": Name(K.ZERO_STAGE, F),
    # checkpoint directory
    "save_folder": Name(K.CHECKPOINT_DIR, F),
    "save_dir": Name(K.CHECKPOINT_DIR, F),
    "output_dir": Name(K.CHECKPOINT_DIR, F, rank=1),
    "save": Name(K.CHECKPOINT_DIR, F),
    "checkpoints_path": Name(K.CHECKPOINT_DIR, F),
    "result_dir": Name(K.CHECKPOINT_DIR, F, rank=1),
    "ckpt_save_path": Name(K.CHECKPOINT_DIR, C, rank=2),
    "checkpoint_dir": Name(K.CHECKPOINT_DIR, C, rank=3),
    "ckpt_dir": Name(K.CHECKPOINT_DIR, C, rank=3),
    "out_dir": Name(K.CHECKPOINT_DIR, C, rank=3),
    "save_path": Name(K.CHECKPOINT_DIR, C, rank=4),
    "outdir": Name(K.CHECKPOINT_DIR, C, rank=4),
    "exp_dir": Name(K.CHECKPOINT_DIR, C, rank=5),
    "checkpoint_path": Name(K.CHECKPOINT_DIR, C, rank=4),
    "default_local_dir": Name(K.CHECKPOINT_DIR, F),  # verl trainer.*
    "default_root_dir": Name(K.CHECKPOINT_DIR, F, rank=4, fallback=True),  # Lightning
    "save_ckpt_path": Name(K.CHECKPOINT_DIR, C, rank=2),
    # topology copies
    "num_nodes": Name(K.NODES, F, topology=True),
    "nnodes": Name(K.NODES, F, topology=True),
    "num_machines": Name(K.NODES, F, topology=True),
    "nodes": Name(K.NODES, C, rank=2, topology=True),
    "devices": Name(K.GPUS_PER_NODE, F, topology=True),
    "num_gpus": Name(K.GPUS_PER_NODE, F, topology=True),
    "nproc_per_node": Name(K.GPUS_PER_NODE, F, topology=True),
    "gpus_per_node": Name(K.GPUS_PER_NODE, F, topology=True),
    "gpus": Name(K.GPUS_PER_NODE, C, rank=2, topology=True),
}
# Key paths (last components) whose meaning needs the parent: checked before NAMES.
PATHS: dict[tuple[str, ...], Name] = {
    ("zero_optimization", "stage"): Name(K.ZERO_STAGE, F),
    ("exp_manager", "explicit_log_dir"): Name(K.CHECKPOINT_DIR, F),
    ("exp_manager", "exp_dir"): Name(K.CHECKPOINT_DIR, F, rank=1),
    ("activation_checkpoint", "mode"): Name(K.RECOMPUTE, F),
    ("ckpt", "dir"): Name(K.CHECKPOINT_DIR, C, rank=2),
    ("checkpoint", "dir"): Name(K.CHECKPOINT_DIR, C, rank=2),
    ("init_args", "dirpath"): Name(K.CHECKPOINT_DIR, F),
    ("actor", "ppo_micro_batch_size_per_gpu"): Name(K.MICRO_BATCH, F),  # verl PPO/GRPO/RLOO
}
# Key paths that look like a knob but are not one (torchtune's checkpointer.checkpoint_dir is
# where the weights are read from).
# verl's reward_model.micro_batch_size_per_gpu is an inference batch, not the training one.
IGNORED_PATHS = frozenset(
    {
        ("checkpointer", "checkpoint_dir"),
        ("checkpointer", "output_dir"),
        ("reward_model", "micro_batch_size_per_gpu"),
    }
)
# Names that never mean a knob whatever their last component says.
IGNORED = frozenset(
    {
        "preprocessing_num_workers",
        "valid_num_workers",
        "activation_checkpointing_reentrant",
        "resume_checkpoint_path",
        "eval_accumulation_steps",
    }
)
# A batch size under one of these parents is the evaluation batch.
_EVAL_PARENTS = re.compile(r"(?:^|_)(?:eval|val|valid|validation|test)(?:_|$)")
_EVAL_NAMES: dict[str, Name] = {
    "per_device_eval_batch_size": Name(K.EVAL_BATCH, F),
    "device_eval_batch_size": Name(K.EVAL_BATCH, F),
    "eval_batch_size": Name(K.EVAL_BATCH, C, rank=1),
    "val_batch_size": Name(K.EVAL_BATCH, C, rank=1),
    "val_batchsize": Name(K.EVAL_BATCH, C, rank=1),
    "valid_batchsize": Name(K.EVAL_BATCH, C, rank=1),
    "validation_batch_size": Name(K.EVAL_BATCH, C, rank=1),  # timm
    "valid_batch_size": Name(K.EVAL_BATCH, C, rank=1),
    "eval_micro_batch_size": Name(K.EVAL_BATCH, F),
    "test_batch_size": Name(K.EVAL_BATCH, C, rank=2),
    "test_batchsize": Name(K.EVAL_BATCH, C, rank=2, fallback=True),
}
NAMES.update(_EVAL_NAMES)

# Config files with a fixed schema: DeepSpeed's JSON and accelerate's YAML.
DEEPSPEED_KEYS: dict[tuple[str, ...], Knob] = {
    ("train_micro_batch_size_per_gpu",): K.MICRO_BATCH,
    ("gradient_accumulation_steps",): K.GRAD_ACCUM,
    ("train_batch_size",): K.GLOBAL_BATCH,
    ("zero_optimization", "stage"): K.ZERO_STAGE,
}
ACCELERATE_KEYS: dict[tuple[str, ...], Name] = {
    ("num_machines",): Name(K.NODES, F, topology=True),
    ("deepspeed_config", "gradient_accumulation_steps"): Name(K.GRAD_ACCUM, F),
    ("deepspeed_config", "zero_stage"): Name(K.ZERO_STAGE, F),
    ("fsdp_config", "fsdp_activation_checkpointing"): Name(K.RECOMPUTE, F),
}

# Paths of checkpoint directories that are read, not written (never the checkpoint dir).
RESUME_NAMES = frozenset(
    {
        "resume_from_checkpoint",
        "resume",
        "load",
        "auto_resume",
        "ckpt_path",
        "load_path",
        "ckpt_load_path",
        "resume_from",
        "load_checkpoint",
        "load_ckpt_path",
    }
)


def normalise(name: str) -> str:
    return name.lstrip("-+~").lower().replace("-", "_")


def lookup(
    path: tuple[str, ...], users: dict[str, Knob], *, siblings: frozenset[str] = frozenset()
) -> Name | None:
    """The knob a flag or key names: `path` is its normalised components (`model`,
    `micro_batch_size`); `siblings` the other names set in the same place."""
    if not path:
        return None
    last = path[-1]
    dotted = ".".join(path)
    for candidate in (dotted, last):
        if candidate in users:
            return Name(users[candidate], Basis.USER)
    if last in IGNORED or path[-2:] in IGNORED_PATHS:
        return None
    for length in (3, 2):
        name = PATHS.get(path[-length:]) if len(path) >= length else None
        if name is not None:
            return name
    if last == "train_batch_size":
        return _train_batch_size(path, siblings)
    if last == "dirpath":  # a ModelCheckpoint's own flag; under another parent it is unknown
        return Name(K.CHECKPOINT_DIR, C, rank=2) if len(path) == 1 else None
    name = NAMES.get(last)
    if name is None:
        return None
    if last == "batch_size":
        if "micro_batch_size" in siblings:  # alpaca-lora: batch_size is the effective batch
            return Name(K.GLOBAL_BATCH, C, rank=5)
        if any(_EVAL_PARENTS.search(part) for part in path[:-1]):
            return Name(K.EVAL_BATCH, C, rank=2)
    if last == "mode" and len(path) == 1:
        return None
    return name


_MICRO_SIBLINGS = frozenset(
    {"micro_train_batch_size", "micro_batch_size", "train_micro_batch_size_per_gpu"}
)


def _train_batch_size(path: tuple[str, ...], siblings: frozenset[str]) -> Name | None:
    """`--train_batch_size` is per device in diffusers' and most argparse scripts, but the
    global batch beside a micro-batch flag (OpenRLHF, DeepSpeed), and a prompt count under
    verl's `data.`: read only as a flag or top-level key, and never under a parent."""
    if len(path) != 1:
        return None
    if siblings & _MICRO_SIBLINGS:
        return Name(K.GLOBAL_BATCH, C, rank=3)
    return Name(K.MICRO_BATCH, C, rank=3)


# ---------------------------------------------------------------- launchers


class LauncherKind(StrEnum):
    TORCHRUN = "torchrun"
    ACCELERATE = "accelerate"
    DEEPSPEED = "deepspeed"
    COMPOSER = "composer"
    PYTHON = "python"
    TUNE = "tune"
    CLI = "cli"  # a framework's own command: llamafactory-cli train, litgpt, fairseq-train...
    WRAPPER = "wrapper"  # a script the job runs that was not given


# Framework commands that train: (command, subcommand or "") -> the program's name.
CLI_COMMANDS: dict[tuple[str, str], str] = {
    ("llamafactory-cli", "train"): "llamafactory-cli train",
    ("litgpt", "pretrain"): "litgpt pretrain",
    ("litgpt", "finetune"): "litgpt finetune",
    ("litgpt", "finetune_full"): "litgpt finetune_full",
    ("litgpt", "finetune_lora"): "litgpt finetune_lora",
    ("axolotl", "train"): "axolotl train",
    ("fairseq-train", ""): "fairseq-train",
    ("fairseq-hydra-train", ""): "fairseq-hydra-train",
}
_PYTHON = re.compile(r"python[0-9.]*\Z")


def launcher_kind(base: str, following: str) -> tuple[LauncherKind, int] | None:
    """The launcher a command word is (`base` is its basename, `following` the next word),
    with how many words it takes before its own options; None when it is none."""
    simple = {
        "torchrun": LauncherKind.TORCHRUN,
        "deepspeed": LauncherKind.DEEPSPEED,
        "composer": LauncherKind.COMPOSER,
        "accelerate-launch": LauncherKind.ACCELERATE,
    }
    if base in simple:
        return simple[base], 1
    if base == "accelerate" and following == "launch":
        return LauncherKind.ACCELERATE, 2
    if base == "tune" and following == "run":
        return LauncherKind.TUNE, 2
    if (base, following) in CLI_COMMANDS:
        return LauncherKind.CLI, 2
    if (base, "") in CLI_COMMANDS:
        return LauncherKind.CLI, 1
    if _PYTHON.match(base) and following and following != "-c":
        return LauncherKind.PYTHON, 1
    return None


@dataclass(frozen=True)
class LauncherOptions:
    """The options a launcher reads before the program: which take a value, which set what."""

    valued: frozenset[str]
    flags: frozenset[str]
    knobs: dict[str, Name]
    configs: dict[str, str]  # option -> config kind ("accelerate", "deepspeed")
    module_flags: frozenset[str] = frozenset({"m", "module"})


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Programs that never start training and whose arguments are not a command to follow.
NOT_LAUNCHERS = _words(
    "echo printf cat mkdir rm cp mv ls ln touch chmod grep sed awk head tail wc sort date "
    "sleep wait kill hostname scontrol squeue sinfo sacct nvidia-smi module ml pip pip3 git "
    "wandb huggingface-cli dcgmi set unset shift exit return trap ulimit umask test [ [[ "
    "true false clear reset nvcc which tee find tar wget curl basename dirname realpath "
    "readlink pwd history alias printenv env_parallel popd jq shuf seq comm cut tr pushd cd "
    "getent id whoami uname free df du ps top lscpu numastat ibstat ibv_devinfo ldd xargs"
)

_TOPOLOGY_NODES = Name(K.NODES, F, topology=True)
_TOPOLOGY_GPUS = Name(K.GPUS_PER_NODE, F, topology=True)

LAUNCHERS: dict[LauncherKind, LauncherOptions] = {
    LauncherKind.TORCHRUN: LauncherOptions(
        valued=_words(
            "nnodes nproc_per_node node_rank master_addr master_port rdzv_id "
            "rdzv_backend rdzv_endpoint rdzv_conf max_restarts monitor_interval "
            "start_method role tee redirects log_dir local_addr logs_specs "
            "local_ranks_filter"
        ),
        flags=_words("standalone no_python run_path use_env m module"),
        knobs={"nnodes": _TOPOLOGY_NODES, "nproc_per_node": _TOPOLOGY_GPUS},
        configs={},
    ),
    LauncherKind.ACCELERATE: LauncherOptions(
        valued=_words(
            "config_file num_processes num_machines machine_rank main_process_ip "
            "main_process_port mixed_precision gradient_accumulation_steps rdzv_conf "
            "rdzv_backend max_restarts role tee deepspeed_config_file zero_stage "
            "gpu_ids num_cpu_threads_per_process dynamo_backend "
            "deepspeed_multinode_launcher deepspeed_hostfile offload_optimizer_device "
            "offload_param_device zero3_init_flag zero3_save_16bit_model "
            "fsdp_sharding_strategy fsdp_auto_wrap_policy "
            "fsdp_transformer_layer_cls_to_wrap fsdp_backward_prefetch "
            "fsdp_state_dict_type fsdp_offload_params fsdp_activation_checkpointing "
            "monitor_interval main_training_function log_dir redirects local_addr"
        ),
        flags=_words(
            "multi_gpu use_deepspeed use_fsdp use_megatron_lm cpu debug quiet m "
            "module no_python same_network mps tpu"
        ),
        knobs={
            "num_machines": _TOPOLOGY_NODES,
            "gradient_accumulation_steps": Name(K.GRAD_ACCUM, F),
            "zero_stage": Name(K.ZERO_STAGE, F),
            "fsdp_activation_checkpointing": Name(K.RECOMPUTE, F),
        },
        configs={"config_file": "accelerate", "deepspeed_config_file": "deepspeed"},
    ),
    LauncherKind.DEEPSPEED: LauncherOptions(
        valued=_words(
            "num_gpus num_nodes hostfile include exclude master_port master_addr "
            "launcher launcher_args node_rank ssh_port min_elastic_nodes "
            "max_elastic_nodes autotuning"
        ),
        flags=_words("no_python module no_local_rank force_multi bind_cores_to_rank"),
        knobs={"num_nodes": _TOPOLOGY_NODES, "num_gpus": _TOPOLOGY_GPUS},
        configs={},
    ),
    LauncherKind.COMPOSER: LauncherOptions(
        valued=_words(
            "nproc n world_size node_rank master_addr master_port base_rank stdout "
            "stderr run_directory"
        ),
        flags=_words("verbose v m module_mode no_python"),
        knobs={"nproc": _TOPOLOGY_GPUS, "n": _TOPOLOGY_GPUS},
        configs={},
    ),
    LauncherKind.PYTHON: LauncherOptions(
        valued=_words("w x c"),
        flags=_words("u o oo b e s i q bb d v h r uu"),
        knobs={},
        configs={},
    ),
}

# Program flags whose value is a config file: kind by flag ("training" unless said).
CONFIG_FLAGS: dict[str, str] = {
    "deepspeed": "deepspeed",
    "deepspeed_config": "deepspeed",
    "deepspeed_config_file": "deepspeed",
    "ds_config": "deepspeed",
    "config": "training",
    "config_file": "training",
    "config_path": "training",
    "cfg": "training",
    "config_yaml": "training",
    "yaml_config": "training",
    "args": "training",
    "job.config_file": "training",
    "config_dir": "directory",
}
# Flags whose value is a comma-separated list of key=value overrides (HF run_clm).
OVERRIDE_LIST_FLAGS = frozenset({"config_overrides"})
CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml")
# Program names of work that is not the training run (a run may also evaluate or serve).
AUXILIARY = re.compile(
    r"(?:^|[/_.-])(?:eval\w*|evaluate|inference|infer|serve\w*|server|"
    r"generate|predict|prepare\w*|preprocess\w*|convert\w*|download\w*|test)"
    r"(?:[/_.-]|\Z)"
)
TRAINING = re.compile(
    r"(?:^|[/_.-])(?:train|finetune|fine_tune|pretrain|sft|fit|distill|run_clm|run_mlm|dpo|ppo|"
    r"grpo|rlhf|main_training)",
    re.IGNORECASE,
)
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
LIGHTNING_DEEPSPEED_VARIABLE = "PL_DEEPSPEED_CONFIG_PATH"  # DeepSpeedStrategy.DEEPSPEED_ENV_VAR
# Lightning's registered DeepSpeed strategies: deepspeed_stage_1, _2, _2_offload, _3, _3_offload,
# _3_offload_nvme (lightning/pytorch/strategies/deepspeed.py, register_strategies).
_LIGHTNING_STAGE = re.compile(
    r"(?P<quote>['\"]?)deepspeed_stage_(?P<stage>[0-9])(?:_offload(?:_nvme)?)?(?P=quote)\Z"
)


def lightning_stage(value: Text) -> Text | None:
    """The ZeRO stage inside a Lightning strategy name: the digit of `deepspeed_stage_2_offload`,
    with its place, so a change rewrites only the digit (or the variable it came from)."""
    match = _LIGHTNING_STAGE.match(value.plain)
    return value.slice(match.start("stage"), match.end("stage")) if match else None
