"""Where the analysis finds each knob: values followed through the shell and config files to
the place they are written, run-time values said to be so, and the places new text can go."""

from __future__ import annotations

import pytest

from daemon.importer import (
    Analysis,
    Basis,
    Effect,
    Form,
    ImporterError,
    Knob,
    KnobReading,
    Site,
    Status,
    analyse,
    parse_knob_mapping,
)

HEADER = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gres=gpu:4\n"


def read(body: str, files: dict[str, str] | None = None, **options: object) -> Analysis:
    return analyse(HEADER + body, name="job.sbatch", files=files, **options)  # type: ignore[arg-type]


def knob(analysis: Analysis, which: Knob) -> KnobReading:
    return analysis.reading(which)


def site_of(reading: KnobReading) -> Site:
    winner = reading.winner
    assert winner is not None
    assert winner.site is not None
    return winner.site


def found(analysis: Analysis, which: Knob) -> tuple[str | None, str]:
    reading = knob(analysis, which)
    assert reading.status is Status.FOUND, reading.reason
    return reading.value, site_of(reading).line.text


# ---------------------------------------------------------------- following values


def test_a_flag_value_is_read_where_it_is_written() -> None:
    analysis = read("srun torchrun --nproc_per_node 4 train.py --per_device_train_batch_size 8\n")
    reading = knob(analysis, Knob.MICRO_BATCH)
    assert (reading.status, reading.value) == (Status.FOUND, "8")
    site = site_of(reading)
    assert (site.text, site.form, site.line.number) == ("8", Form.SHELL_WORD, 4)
    assert HEADER.count("\n") + len("srun torchrun --nproc_per_node 4 train.py ") <= site.start


def test_a_value_in_a_variable_is_sited_at_its_assignment() -> None:
    body = "MBS=12 # per GPU\nsrun python train.py --per_device_train_batch_size $MBS\n"
    assert found(read(body), Knob.MICRO_BATCH) == ("12", "MBS=12 # per GPU")


def test_a_default_is_the_script_value() -> None:
    body = (
        ': "${MICRO_BATCH_SIZE:=2}"\nGBS=${GBS:-256}\n'
        "srun python pretrain_gpt.py --micro-batch-size $MICRO_BATCH_SIZE "
        "--global-batch-size ${GBS}\n"
    )
    analysis = read(body)
    assert found(analysis, Knob.MICRO_BATCH) == ("2", ': "${MICRO_BATCH_SIZE:=2}"')
    assert found(analysis, Knob.GLOBAL_BATCH) == ("256", "GBS=${GBS:-256}")
    assert site_of(knob(analysis, Knob.GLOBAL_BATCH)).text == "256"


def test_a_value_from_a_positional_argument_is_set_at_run_time() -> None:
    body = "BS=$1\nsrun python train.py --per_device_train_batch_size $BS\n"
    reading = knob(read(body), Knob.MICRO_BATCH)
    assert reading.status is Status.RUNTIME
    assert reading.value == "$1"
    assert site_of(reading).line.text == "BS=$1"


def test_a_value_from_the_environment_or_a_command_is_set_at_run_time() -> None:
    body = (
        "OUT=$SCRATCH/runs/$(date +%s)\nsrun python train.py --output_dir $OUT/ckpt "
        "--gradient_accumulation_steps $GAS\n"
    )
    analysis = read(body)
    assert knob(analysis, Knob.CHECKPOINT_DIR).status is Status.RUNTIME
    assert knob(analysis, Knob.CHECKPOINT_DIR).value == "$SCRATCH/runs/$(date +%s)/ckpt"
    accum = knob(analysis, Knob.GRAD_ACCUM)
    assert accum.status is Status.RUNTIME
    assert "environment" in accum.reason


def test_flags_kept_in_an_exported_string_are_followed_into_bash_c() -> None:
    body = (
        'export LAUNCHER="torchrun --nnodes $SLURM_NNODES --nproc_per_node 4"\n'
        'export CMD=" \\\n    train.py \\\n    --per_device_train_batch_size 6 \\\n'
        '    --output_dir /ckpt/run1 \\\n    "\n'
        'srun bash -c "$LAUNCHER --node_rank \\$SLURM_PROCID $CMD" 2>&1 | tee log\n'
    )
    analysis = read(body)
    micro = knob(analysis, Knob.MICRO_BATCH)
    assert (micro.value, site_of(micro).form) == ("6", Form.DOUBLE_QUOTED)
    assert site_of(micro).line.text == "    --per_device_train_batch_size 6 \\"
    assert knob(analysis, Knob.CHECKPOINT_DIR).value == "/ckpt/run1"
    assert analysis.launches[0].line.text.startswith("srun bash -c")
    nodes = knob(analysis, Knob.NODES)
    assert nodes.winner is not None
    assert nodes.winner.basis is Basis.ALLOCATION
    assert [o.effect for o in nodes.occurrences] == [Effect.WINS]  # --nnodes: the same site


def test_a_command_built_by_appends_and_run_through_a_variable() -> None:
    body = 'CMD="python train.py"\nCMD="$CMD --batch_size 16"\nCMD+=" --grad_acc_steps 4"\n$CMD\n'
    analysis = read(body)
    assert found(analysis, Knob.MICRO_BATCH) == ("16", 'CMD="$CMD --batch_size 16"')
    assert found(analysis, Knob.GRAD_ACCUM) == ("4", 'CMD+=" --grad_acc_steps 4"')
    assert knob(analysis, Knob.MICRO_BATCH).winner.basis is Basis.CONVENTION  # type: ignore[union-attr]


def test_arrays_expanded_on_the_launch_line() -> None:
    body = (
        "declare -a ARGS=(\n    --micro-batch-size 2 # per GPU\n    --save /ckpt \\\n)\n"
        'srun python pretrain_gpt.py "${ARGS[@]}" --seq-length 4096\n'
    )
    analysis = read(body)
    assert found(analysis, Knob.MICRO_BATCH) == ("2", "    --micro-batch-size 2 # per GPU")
    assert found(analysis, Knob.CHECKPOINT_DIR) == ("/ckpt", "    --save /ckpt \\")
    assert found(analysis, Knob.SEQ_LEN)[0] == "4096"


def test_hydra_overrides_in_a_read_heredoc() -> None:
    body = (
        "MBS=4\nread -r -d '' cmd <<EOF\ncd /w \\\n&& python train.py \\\n"
        "    trainer.num_nodes=2 \\\n    model.micro_batch_size=${MBS} \\\n"
        '    exp_manager.exp_dir=\\"/results/r1\\" \\\n&& echo "Done"\nEOF\n'
        'srun bash -c "${cmd}"\n'
    )
    analysis = read(body)
    assert found(analysis, Knob.MICRO_BATCH) == ("4", "MBS=4")
    assert knob(analysis, Knob.CHECKPOINT_DIR).value == "/results/r1"
    assert site_of(knob(analysis, Knob.CHECKPOINT_DIR)).form is Form.HEREDOC
    effects = [(o.source, o.effect) for o in knob(analysis, Knob.NODES).occurrences]
    assert effects == [("#SBATCH --nodes", Effect.WINS), ("trainer.num_nodes", Effect.MIRROR)]


def test_a_deepspeed_config_written_by_a_heredoc_is_read_with_its_places() -> None:
    body = (
        "ZERO_STAGE=3\nconfig_json=./ds.$SLURM_JOB_ID.json\n"
        'cat <<EOT > $config_json\n{\n  "train_micro_batch_size_per_gpu": 2,\n'
        '  "gradient_accumulation_steps": "auto",\n'
        '  "zero_optimization": {"stage": $ZERO_STAGE}\n}\nEOT\n'
        "srun python train.py --deepspeed $config_json --gradient_accumulation_steps 8\n"
    )
    analysis = read(body)
    micro = site_of(knob(analysis, Knob.MICRO_BATCH))
    assert (micro.text, micro.form, micro.within) == ("2", Form.JSON, Form.HEREDOC)
    assert found(analysis, Knob.ZERO_STAGE) == ("3", "ZERO_STAGE=3")
    accum = knob(analysis, Knob.GRAD_ACCUM)
    assert accum.value == "8"
    assert len(accum.occurrences) == 1  # "auto" defers to the flag


def test_a_deepspeed_config_by_path_is_asked_for_then_read() -> None:
    body = "srun python train.py --deepspeed_config ds_config.json\n"
    first = read(body)
    assert first.files_wanted == ("ds_config.json",)
    assert knob(first, Knob.ZERO_STAGE).status is Status.RUNTIME
    config = '{\n  "train_batch_size": 400,\n  "zero_optimization": {\n    "stage": 2\n  }\n}\n'
    second = read(body, files={"ds_config.json": config})
    assert second.files_read == ("ds_config.json",)
    stage = site_of(knob(second, Knob.ZERO_STAGE))
    assert (stage.file, stage.text, stage.form, stage.line.number) == (
        "ds_config.json",
        "2",
        Form.JSON,
        4,
    )
    assert found(second, Knob.GLOBAL_BATCH) == ("400", '  "train_batch_size": 400,')


def test_hf_training_arguments_json_as_the_single_argument() -> None:
    config = '{"per_device_train_batch_size": 4, "output_dir": "out/run", "bf16": true}'
    analysis = read("srun torchrun train.py args.json\n", files={"args.json": config})
    assert found(analysis, Knob.MICRO_BATCH)[0] == "4"
    checkpoint = knob(analysis, Knob.CHECKPOINT_DIR)
    assert checkpoint.value == "out/run"
    assert site_of(checkpoint).text == '"out/run"'


def test_an_accelerate_config_file_gives_the_zero_stage() -> None:
    config = (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: 2\n"
        "  zero_stage: 3\nnum_machines: 2\n"
    )
    body = (
        "srun accelerate launch --config_file acc.yaml train.py --per_device_train_batch_size 1\n"
    )
    analysis = read(body, files={"acc.yaml": config})
    assert found(analysis, Knob.ZERO_STAGE) == ("3", "  zero_stage: 3")
    assert site_of(knob(analysis, Knob.ZERO_STAGE)).form is Form.YAML


def test_a_yaml_value_overridden_on_the_command_line() -> None:
    config = "global_train_batch_size: 512\nsave_folder: ./ckpt/{run_name}\nmax_seq_len: 2048\n"
    body = "composer train.py run.yaml save_folder=/lustre/ckpt max_seq_len=4096\n"
    analysis = read(body, files={"run.yaml": config})
    checkpoint = knob(analysis, Knob.CHECKPOINT_DIR)
    assert checkpoint.value == "/lustre/ckpt"
    assert [o.effect for o in checkpoint.occurrences] == [Effect.WINS, Effect.OVERRIDDEN]
    assert checkpoint.occurrences[1].site is not None
    assert checkpoint.occurrences[1].site.file == "run.yaml"
    assert found(analysis, Knob.GLOBAL_BATCH) == ("512", "global_train_batch_size: 512")


def test_a_switch_or_an_interval_named_save_is_not_a_directory() -> None:
    config = "save: true\ncheckpointing:\n  save: 1000\noutput_dir: out/run\n"
    analysis = read("python train.py cfg.yaml\n", files={"cfg.yaml": config})
    assert found(analysis, Knob.CHECKPOINT_DIR) == ("out/run", "output_dir: out/run")


def test_omegaconf_interpolations_lead_to_the_value() -> None:
    config = "variables:\n  max_seq_len: 2048\nmax_seq_len: ${variables.max_seq_len}\n"
    analysis = read("composer train.py run.yaml\n", files={"run.yaml": config})
    assert found(analysis, Knob.SEQ_LEN) == ("2048", "  max_seq_len: 2048")


def test_the_same_knob_in_the_launcher_and_the_program_must_agree() -> None:
    body = (
        "srun accelerate launch --gradient_accumulation_steps 4 --num_machines 2 "
        "train.py --gradient_accumulation_steps 4\n"
    )
    occurrences = knob(read(body), Knob.GRAD_ACCUM).occurrences
    assert [(o.source, o.effect) for o in occurrences] == [
        ("--gradient_accumulation_steps", Effect.WINS),
        ("--gradient_accumulation_steps", Effect.MIRROR),
    ]
    assert occurrences[0].site is not None
    assert occurrences[1].site is not None
    assert occurrences[0].site.start > occurrences[1].site.start


def test_a_flag_given_twice_the_last_wins() -> None:
    body = "srun python train.py --per_device_train_batch_size 2 --per_device_train_batch_size 8\n"
    occurrences = knob(read(body), Knob.MICRO_BATCH).occurrences
    assert [(o.value, o.effect) for o in occurrences] == [
        ("8", Effect.WINS),
        ("2", Effect.OVERRIDDEN),
    ]


def test_megatron_flags() -> None:
    body = (
        "CKPT=/lustre/ckpt/gpt\nsrun python pretrain_gpt.py --micro-batch-size 1 "
        "--global-batch-size 512 --recompute-granularity selective --save $CKPT --load $CKPT "
        "--seq-length 2048 --num-workers 2\n"
    )
    analysis = read(body)
    assert found(analysis, Knob.RECOMPUTE)[0] == "selective"
    assert found(analysis, Knob.CHECKPOINT_DIR) == ("/lustre/ckpt/gpt", "CKPT=/lustre/ckpt/gpt")
    assert found(analysis, Knob.WORKERS)[0] == "2"
    assert analysis.launches[0].resume_flags == ("--load",)


def test_a_presence_flag_turns_recompute_on() -> None:
    reading = knob(read("srun python train.py --gradient_checkpointing --bf16\n"), Knob.RECOMPUTE)
    assert reading.value == "true"
    assert reading.winner is not None
    assert reading.winner.presence
    assert site_of(reading).text == "--gradient_checkpointing"


def test_a_users_mapping_names_a_scripts_own_flag() -> None:
    body = "srun torchrun train.py --train_bs=1 --val_batch_size=2\n"
    assert knob(read(body), Knob.MICRO_BATCH).status is Status.NOT_FOUND
    flag, which = parse_knob_mapping("micro_batch=--train_bs")
    mapped = read(body, knob_names={flag: which})
    micro = knob(mapped, Knob.MICRO_BATCH)
    assert micro.value == "1"
    assert micro.winner is not None
    assert micro.winner.basis is Basis.USER
    assert found(mapped, Knob.EVAL_BATCH)[0] == "2"


@pytest.mark.parametrize("text", ["micro_batch", "tiny=--x", "micro_batch="])
def test_a_bad_mapping_is_refused(text: str) -> None:
    with pytest.raises(ImporterError):
        parse_knob_mapping(text)


def test_alpaca_style_batch_size_next_to_micro_batch_size_is_the_global_batch() -> None:
    analysis = read("python finetune.py --batch_size 32 --micro_batch_size 4\n")
    assert found(analysis, Knob.MICRO_BATCH)[0] == "4"
    assert found(analysis, Knob.GLOBAL_BATCH)[0] == "32"


def test_the_allocator_setting_must_be_exported() -> None:
    exported = read('export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"\npython t.py\n')
    assert found(exported, Knob.ALLOC_CONF)[0] == "expandable_segments:True"
    plain = read("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\npython t.py\n")
    assert knob(plain, Knob.ALLOC_CONF).status is Status.NOT_FOUND
    assert any("not exported" in note for note in plain.notes)
    prefixed = read("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 python t.py\n")
    assert found(prefixed, Knob.ALLOC_CONF)[0] == "max_split_size_mb:128"


def test_a_knob_nobody_sets_is_not_found() -> None:
    reading = knob(read("srun python train.py --lr 1e-4\n"), Knob.MICRO_BATCH)
    assert (reading.status, reading.value, reading.occurrences) == (Status.NOT_FOUND, None, ())


def test_a_missing_training_config_makes_its_knobs_run_time() -> None:
    analysis = read(
        "srun python train.py --config configs/big.yaml --per_device_train_batch_size 2\n"
    )
    assert analysis.files_wanted == ("configs/big.yaml",)
    assert knob(analysis, Knob.MICRO_BATCH).status is Status.FOUND
    seq = knob(analysis, Knob.SEQ_LEN)
    assert seq.status is Status.RUNTIME
    assert "was not given" in seq.reason


def test_arguments_passed_through_from_submission_make_unset_knobs_run_time() -> None:
    analysis = read('srun python train.py --per_device_train_batch_size 2 "$@"\n')
    assert knob(analysis, Knob.MICRO_BATCH).status is Status.FOUND
    assert knob(analysis, Knob.GRAD_ACCUM).status is Status.RUNTIME
    assert knob(analysis, Knob.NODES).status is Status.FOUND


# ---------------------------------------------------------------- shell control flow


def test_a_branch_the_script_decides_is_taken() -> None:
    body = (
        'EXTRA=""\nSIZE=7\nif [ -n "$EXTRA" ]; then MBS=1; elif [[ $SIZE == 7 ]]; then MBS=4; '
        "else MBS=9; fi\npython train.py --per_device_train_batch_size $MBS\n"
    )
    assert found(read(body), Knob.MICRO_BATCH)[0] == "4"


def test_a_branch_decided_at_run_time_makes_the_value_run_time() -> None:
    body = (
        'case "$1" in\n  big) OUT=runs/big ;;\n  small) OUT=runs/small ;;\nesac\n'
        "python train.py --output_dir $OUT\n"
    )
    reading = knob(read(body), Knob.CHECKPOINT_DIR)
    assert reading.status is Status.RUNTIME
    assert "condition" in reading.reason
    lines = {line.text for o in reading.occurrences for line in o.lines()}
    assert "  big) OUT=runs/big ;;" in lines


def test_a_required_argument_is_run_time() -> None:
    reading = knob(
        read('OUT="${1:?usage}"\npython t.py --output_dir "$OUT"\n'), Knob.CHECKPOINT_DIR
    )
    assert reading.status is Status.RUNTIME


def test_space_after_equals_leaves_the_variable_unset() -> None:
    body = 'CONFIG= "/x/run.yaml"\ntorchrun train.py --config-file $CONFIG\n'
    reading = knob(read(body), Knob.MICRO_BATCH)
    assert reading.status is Status.RUNTIME
    assert reading.value == "$CONFIG"


def test_a_wrapper_script_is_asked_for_and_followed() -> None:
    body = "srun ./scripts/train.sh\n"
    first = read(body)
    assert first.files_wanted == ("scripts/train.sh",)
    assert knob(first, Knob.MICRO_BATCH).status is Status.RUNTIME
    wrapper = 'ARGS="\n--batch_size=2\n--ckpt_save_path=/l/ckpt\n"\ntorchrun main.py ${ARGS}'
    second = read(body, files={"scripts/train.sh": wrapper})
    micro = site_of(knob(second, Knob.MICRO_BATCH))
    assert (micro.file, micro.text, micro.line.text) == ("scripts/train.sh", "2", "--batch_size=2")
    assert second.launches[0].args_end.file == "scripts/train.sh"


def test_a_sourced_script_that_is_missing_makes_knobs_run_time() -> None:
    analysis = read("source ./train_ppo.sh slurm\nsrun torchrun ${training_commands}\n")
    assert analysis.files_wanted == ("train_ppo.sh",)
    reading = knob(analysis, Knob.MICRO_BATCH)
    assert reading.status is Status.RUNTIME
    assert "train_ppo.sh" in reading.reason


def test_functions_and_eval_are_followed() -> None:
    body = 'run() { python train.py --per_device_train_batch_size "$1"; }\nrun 3\n'
    assert found(read(body), Knob.MICRO_BATCH)[0] == "3"
    evaluated = read('cmd="torchrun train.py --seq_len 512"\neval "${cmd}"\n')
    assert found(evaluated, Knob.SEQ_LEN)[0] == "512"


def test_paths_resolve_against_cd_and_the_owners_home_is_left_to_the_caller() -> None:
    body = "cd src/training\naccelerate launch t.py --config run.yaml\n"
    assert read(body).files_wanted == ("src/training/run.yaml",)
    home = read("tune run recipe --config /home/$USER/cfg.yaml\n")
    assert home.files_wanted == ("/home/$USER/cfg.yaml",)
    answered = read(
        "tune run recipe --config /home/$USER/cfg.yaml\n",
        files={"/home/$USER/cfg.yaml": "batch_size: 4\n"},
    )
    assert found(answered, Knob.MICRO_BATCH)[0] == "4"


# ---------------------------------------------------------------- directives


def test_directive_lookalikes_and_late_directives_are_not_read() -> None:
    script = (
        "#!/bin/bash\n# SBATCH -N 8\n##SBATCH --gres=gpu:8\n#SBATCz --nodes=3\n#SBATCH --nodes 1\n"
        "echo start\n#SBATCH --gpus-per-node=2\npython t.py\n"
    )
    analysis = analyse(script)
    assert [(d.option, d.value) for d in analysis.directives] == [("nodes", "1")]
    assert knob(analysis, Knob.NODES).value == "1"
    assert knob(analysis, Knob.GPUS_PER_NODE).status is Status.NOT_FOUND
    assert sum("not read by Slurm" in note for note in analysis.notes) == 4


@pytest.mark.parametrize(
    ("directives", "gpus", "text"),
    [
        ("#SBATCH --gres=gpu:a100:4,nvme:10", "4", "4"),
        ("#SBATCH --gres=gpu:A100.40gb:1", "1", "1"),
        ("#SBATCH --gpus-per-node=h100:8", "8", "8"),
        ("#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-task=8", "8", "8"),
        ("#SBATCH -N 2\n#SBATCH -G 8", "4", None),
        ("#SBATCH --gres=[4 A100 80g]", None, None),
    ],
)
def test_gpus_per_node_from_the_gpu_directives(
    directives: str, gpus: str | None, text: str | None
) -> None:
    reading = knob(analyse(f"#!/bin/bash\n{directives}\npython t.py\n"), Knob.GPUS_PER_NODE)
    assert reading.value == gpus
    site = reading.winner.site if reading.winner else None
    assert (site.text if site else None) == text


def test_several_options_on_one_line_and_heterogeneous_jobs() -> None:
    script = (
        "#!/bin/bash\n#SBATCH -N 1 --gpus-per-node=4 -t 1:00:00\n#SBATCH hetjob\n"
        "#SBATCH -N 3 --gpus-per-node=8 --exclusive\n"
        "srun --het-group=0 python serve.py &\n"
        'srun --het-group=1 bash -c "python train.py --per_device_train_batch_size 2"\n'
    )
    analysis = analyse(script)
    assert knob(analysis, Knob.NODES).value == "3"
    assert knob(analysis, Knob.GPUS_PER_NODE).value == "8"
    primary = [launch for launch in analysis.launches if launch.primary]
    assert [(launch.program, launch.het_group) for launch in primary] == [("train.py", 1)]


def test_slurm_variables_lead_back_to_their_directive() -> None:
    script = (
        "#!/bin/bash\n#SBATCH --cpus-per-task=6\npython t.py --num_workers=$SLURM_CPUS_PER_TASK\n"
    )
    reading = knob(analyse(script), Knob.WORKERS)
    assert reading.value == "6"
    assert site_of(reading).form is Form.DIRECTIVE
    assert site_of(reading).line.number == 2


def test_the_launchers_copy_of_the_topology_is_checked_against_the_allocation() -> None:
    body = "GPUS=2\nsrun torchrun --nproc_per_node $GPUS train.py\n"
    analysis = read(body)
    assert knob(analysis, Knob.GPUS_PER_NODE).value == "4"
    assert any("4 from #SBATCH --gres but 2 from --nproc_per_node" in n for n in analysis.notes)


# ---------------------------------------------------------------- insertion points


def insertion_context(analysis: Analysis, script: str) -> tuple[str, str]:
    insertion = analysis.launches[0].args_end
    assert insertion.offset is not None, insertion.why
    return script[: insertion.offset], script[insertion.offset :]


@pytest.mark.parametrize(
    ("launch", "after"),
    [
        ("python train.py --bs 16 2>&1 | tee log\n", " 2>&1 | tee log\n"),
        ("python train.py --bs 16 && echo finished\n", " && echo finished\n"),
        ("python train.py --bs 16 \\\n    > out.log\n", " \\\n    > out.log\n"),
        ("python train.py --bs 16\\\n\n", "\\\n\n"),
        ('srun bash -c "python train.py --bs 16 $CMD" &>> log\n', '" &>> log\n'),
    ],
)
def test_a_flag_is_appended_after_the_last_argument(launch: str, after: str) -> None:
    script = HEADER + launch
    assert insertion_context(analyse(script), script)[1] == after


def test_inside_a_string_built_from_variables_the_flag_goes_after_the_last_variable() -> None:
    script = (
        HEADER + 'ARGS="--lr 1 \\\n    "\nCMD="train.py $ARGS"\n'
        "srun bash -c 'torchrun $CMD' 2>&1 | tee log\n"
    )
    analysis = analyse(script)
    before, after = insertion_context(analysis, script)
    assert before.endswith("torchrun $CMD")
    assert after.startswith("' 2>&1")
    assert analysis.launches[0].args_end.form is Form.SINGLE_QUOTED


def test_a_heredoc_command_followed_by_more_commands_gets_the_flag_in_the_heredoc() -> None:
    script = (
        HEADER + "read -r -d '' cmd <<EOF\npython train.py \\\n    a.b=1 \\\n&& echo Done\nEOF\n"
        'srun bash -c "${cmd}"\n'
    )
    analysis = analyse(script)
    before, after = insertion_context(analysis, script)
    assert before.endswith("a.b=1")
    assert after.startswith(" \\\n&& echo Done")
    assert analysis.launches[0].args_end.form is Form.HEREDOC


def test_a_computed_last_argument_has_no_insertion_point() -> None:
    analysis = analyse(HEADER + "srun bash -c $'python train.py --x\\t1'\n")
    insertion = analysis.launches[0].args_end
    assert insertion.offset is None
    assert "computed" in insertion.why


def test_exports_go_after_the_header() -> None:
    script = HEADER + "\nset -e\npython t.py\n"
    insertion = analyse(script).env_insertion
    assert insertion.offset == len(HEADER)
    bare = analyse("#SBATCH --nodes=1")
    assert bare.env_insertion.offset == len("#SBATCH --nodes=1")
    assert bare.env_insertion.newline_before


# ---------------------------------------------------------------- places in the text


def test_sites_index_the_text_and_its_utf8_bytes() -> None:
    script = (
        "#!/bin/bash\n#SBATCH --gres=gpu:6   #指定GPU数量\n# 训练\nBS=4 # 批量\n"
        "python t.py --batch_size $BS\n"
    )
    analysis = analyse(script)
    data = script.encode("utf-8")
    for which in (Knob.MICRO_BATCH, Knob.GPUS_PER_NODE):
        site = site_of(knob(analysis, which))
        assert script[site.start : site.end] == site.text
        assert data[site.byte_start : site.byte_end].decode("utf-8") == site.text
    assert site_of(knob(analysis, Knob.MICRO_BATCH)).byte_start > script.index("BS=4") + 3


def test_bytes_that_are_not_utf8_keep_their_offsets() -> None:
    raw = b"#!/bin/bash\n# caf\xe9\nBS=4\npython t.py --batch_size $BS\n"
    script = raw.decode("utf-8", "surrogateescape")
    site = site_of(knob(analyse(script), Knob.MICRO_BATCH))
    assert raw[site.byte_start : site.byte_end] == b"4"


def test_oversized_and_binary_input_is_refused() -> None:
    with pytest.raises(ImporterError):
        analyse("x" * 2_000_000)
    with pytest.raises(ImporterError):
        analyse("#!/bin/bash\n\0")


def test_an_oversized_config_is_left_unread_with_a_note() -> None:
    analysis = read("python t.py --config big.yaml\n", files={"big.yaml": "a: 1\n" * 300_000})
    assert knob(analysis, Knob.MICRO_BATCH).status is Status.RUNTIME
    assert any("big.yaml: not read" in note for note in analysis.notes)
