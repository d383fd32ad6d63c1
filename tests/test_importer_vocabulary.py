"""The names the importer reads beyond the first corpus (issue 12's second held-out set):
Lightning's strategies, Trainer flags and DeepSpeed config variable, verl's Hydra keys, common
argparse spellings as conventions, and names it leaves alone (verl's prompt count, llm.c's
letters).
Each name's public source is in daemon/importer/vocabulary.py's docstring."""

from __future__ import annotations

import pytest

from daemon.importer import Analysis, Basis, Effect, Knob, KnobReading, Status, analyse

HEADER = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gres=gpu:8\n"


def read(body: str, header: str = HEADER, **options: object) -> Analysis:
    return analyse(header + body, name="job.sbatch", **options)  # type: ignore[arg-type]


def value_and_basis(reading: KnobReading) -> tuple[Status, str | None, Basis | None]:
    winner = reading.winner
    return reading.status, reading.value, winner.basis if winner is not None else None


def respliced(script: str, reading: KnobReading, new: str) -> str:
    winner = reading.winner
    assert winner is not None
    assert winner.site is not None
    return script[: winner.site.start] + new + script[winner.site.end :]


# ---------------------------------------------------------------- Lightning


def test_a_lightning_deepspeed_strategy_names_the_stage_and_only_its_digit_changes() -> None:
    script = HEADER + "srun python train.py --strategy deepspeed_stage_2_offload --max_epochs 1\n"
    reading = analyse(script).reading(Knob.ZERO_STAGE)
    assert value_and_basis(reading) == (Status.FOUND, "2", Basis.FRAMEWORK)

    changed = respliced(script, reading, "3")

    assert "--strategy deepspeed_stage_3_offload --max_epochs 1\n" in changed
    assert analyse(changed).reading(Knob.ZERO_STAGE).value == "3"


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed", "fsdp", "deepspeed_stage_x"])
def test_a_strategy_without_a_stage_gives_none(strategy: str) -> None:
    analysis = read(f"srun python train.py --strategy {strategy}\n")
    assert analysis.reading(Knob.ZERO_STAGE).status is Status.NOT_FOUND


DS_HEREDOC = (
    "ZERO_STAGE={zero}\nconfig_json=./ds.$SLURM_JOBID.json\n"
    'cat <<EOT > $config_json\n{{\n  "zero_optimization": {{"stage": {stage}}},\n'
    '  "train_micro_batch_size_per_gpu": 4\n}}\nEOT\n'
    "export PL_DEEPSPEED_CONFIG_PATH=$config_json\n"
)


def test_the_config_lightning_reads_from_its_variable_follows_the_strategys_stage() -> None:
    body = DS_HEREDOC.format(zero=2, stage="$ZERO_STAGE") + (
        "python train.py --strategy deepspeed_stage_${ZERO_STAGE} --train_batchsize 4\n"
    )
    analysis = read(body)
    zero = analysis.reading(Knob.ZERO_STAGE)
    assert (zero.value, len(zero.occurrences)) == ("2", 1)  # one place: ZERO_STAGE=2
    assert zero.winner is not None
    assert zero.winner.site is not None
    assert zero.winner.site.line.text == "ZERO_STAGE=2"
    micro = analysis.reading(Knob.MICRO_BATCH)
    assert {o.basis for o in micro.occurrences} == {Basis.FRAMEWORK, Basis.CONVENTION}


def test_the_deepspeed_configs_stage_wins_over_the_strategy_name_which_must_agree() -> None:
    body = DS_HEREDOC.format(zero=1, stage=3) + "python train.py --strategy deepspeed_stage_1\n"
    analysis = read(body)
    zero = analysis.reading(Knob.ZERO_STAGE)
    assert zero.value == "3"
    assert [(o.value, o.effect) for o in zero.occurrences] == [
        ("3", Effect.WINS),
        ("1", Effect.MIRROR),
    ]
    assert "zero_stage: 3 from zero_optimization.stage" in " ".join(analysis.notes)


def test_the_lightning_config_variable_is_not_read_without_a_deepspeed_strategy() -> None:
    body = DS_HEREDOC.format(zero=2, stage=2) + "python train.py --strategy ddp\n"
    assert read(body).reading(Knob.ZERO_STAGE).status is Status.NOT_FOUND


def test_default_root_dir_is_the_checkpoint_dir_unless_a_checkpoint_callback_names_one() -> None:
    alone = read("python train.py --default_root_dir /runs/a\n").reading(Knob.CHECKPOINT_DIR)
    both = read("python train.py --default_root_dir /runs/a --dirpath /runs/a/ckpt\n").reading(
        Knob.CHECKPOINT_DIR
    )
    assert value_and_basis(alone) == (Status.FOUND, "/runs/a", Basis.FRAMEWORK)
    assert value_and_basis(both) == (Status.FOUND, "/runs/a/ckpt", Basis.CONVENTION)
    assert len(both.occurrences) == 1  # another directory, not a copy that must agree


def test_lightning_cli_dotted_flags_are_read_by_their_last_name() -> None:
    analysis = read(
        "srun python cli.py fit --trainer.accumulate_grad_batches 4 --data.batch_size 8 "
        "--trainer.default_root_dir /runs/b --trainer.strategy deepspeed_stage_3\n"
    )
    assert value_and_basis(analysis.reading(Knob.GRAD_ACCUM)) == (
        Status.FOUND,
        "4",
        Basis.FRAMEWORK,
    )
    assert value_and_basis(analysis.reading(Knob.MICRO_BATCH)) == (
        Status.FOUND,
        "8",
        Basis.CONVENTION,
    )
    assert analysis.reading(Knob.CHECKPOINT_DIR).value == "/runs/b"
    assert analysis.reading(Knob.ZERO_STAGE).value == "3"


# ---------------------------------------------------------------- Hydra / verl


def test_verl_sft_overrides_are_read_but_not_its_train_batch_size() -> None:
    analysis = read(
        "CKPT=/ckpt/sft\nsrun torchrun -m verl.trainer.fsdp_sft_trainer "
        "data.train_batch_size=64 data.micro_batch_size_per_gpu=2 "
        "model.enable_gradient_checkpointing=True trainer.default_local_dir=$CKPT\n"
    )
    assert value_and_basis(analysis.reading(Knob.MICRO_BATCH)) == (
        Status.FOUND,
        "2",
        Basis.FRAMEWORK,
    )
    assert analysis.reading(Knob.RECOMPUTE).value == "true"
    assert analysis.reading(Knob.CHECKPOINT_DIR).value == "/ckpt/sft"
    assert analysis.reading(Knob.GLOBAL_BATCH).status is Status.NOT_FOUND
    assert len(analysis.reading(Knob.MICRO_BATCH).occurrences) == 1


def test_verl_ppo_reads_the_actors_micro_batch_only() -> None:
    analysis = read(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=256 "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 "
        "critic.ppo_micro_batch_size_per_gpu=16 reward_model.micro_batch_size_per_gpu=32\n"
    )
    micro = analysis.reading(Knob.MICRO_BATCH)
    assert [(o.value, o.source) for o in micro.occurrences] == [
        ("4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    ]
    assert analysis.reading(Knob.GLOBAL_BATCH).status is Status.NOT_FOUND


# ---------------------------------------------------------------- argparse conventions


F, C = Basis.FRAMEWORK, Basis.CONVENTION


@pytest.mark.parametrize(
    ("flags", "which", "value", "basis"),
    [
        ("--batch-size 8", Knob.MICRO_BATCH, "8", C),
        ("--batch_size=8", Knob.MICRO_BATCH, "8", C),
        ("--train-batch-size 8", Knob.MICRO_BATCH, "8", C),
        ("--train_batchsize 8", Knob.MICRO_BATCH, "8", C),
        ("--val_batchsize 4", Knob.EVAL_BATCH, "4", C),
        ("--valid_batchsize 4", Knob.EVAL_BATCH, "4", C),
        ("--eval-batch-size 4", Knob.EVAL_BATCH, "4", C),
        ("--validation-batch-size 4", Knob.EVAL_BATCH, "4", C),
        ("--grad-checkpointing --lr 1e-4", Knob.RECOMPUTE, "true", C),
        ("--accum-freq 2", Knob.GRAD_ACCUM, "2", C),
        ("--accum_iter 2", Knob.GRAD_ACCUM, "2", C),
        ("--num-workers 6", Knob.WORKERS, "6", F),
        ("--workers=6", Knob.WORKERS, "6", C),
        ("--save_ckpt_path /ck --load_ckpt_path /ck/last.ckpt", Knob.CHECKPOINT_DIR, "/ck", C),
    ],
)
def test_common_argparse_spellings_are_read(
    flags: str, which: Knob, value: str, basis: Basis
) -> None:
    reading = read(f"srun python train.py {flags}\n").reading(which)
    assert value_and_basis(reading) == (Status.FOUND, value, basis)
    assert len(reading.occurrences) == 1


def test_a_users_mapping_overrules_a_convention() -> None:
    body = "srun python train.py --train_batch_size 64 --per_gpu 4\n"
    mapped = read(body, knob_names={"--per_gpu": Knob.MICRO_BATCH})
    micro = mapped.reading(Knob.MICRO_BATCH)
    assert value_and_basis(micro) == (Status.FOUND, "4", Basis.USER)


def test_train_batch_size_beside_a_micro_batch_is_the_global_batch() -> None:
    analysis = read("deepspeed train.py --train_batch_size 128 --micro_train_batch_size 2\n")
    assert analysis.reading(Knob.MICRO_BATCH).value == "2"
    assert value_and_basis(analysis.reading(Knob.GLOBAL_BATCH)) == (
        Status.FOUND,
        "128",
        Basis.CONVENTION,
    )


def test_a_test_batch_size_is_the_eval_batch_only_when_no_validation_one_is_set() -> None:
    both = read("python train.py --val_batchsize 32 --test_batchsize 16\n")
    alone = read("python train.py --test_batchsize 16\n")
    assert [o.value for o in both.reading(Knob.EVAL_BATCH).occurrences] == ["32"]
    assert alone.reading(Knob.EVAL_BATCH).value == "16"


def test_llm_c_single_letter_flags_are_not_guessed() -> None:
    analysis = read('srun bash -c "./train_gpt2cu -b 64 -t 1024 -d 524288 -r 0 -z 1 -o log"\n')
    for which in (Knob.MICRO_BATCH, Knob.SEQ_LEN, Knob.ZERO_STAGE, Knob.RECOMPUTE):
        assert analysis.reading(which).status is Status.NOT_FOUND, which


# ---------------------------------------------------------------- Slurm's own variables


def test_a_default_for_a_variable_slurm_always_sets_is_never_the_value() -> None:
    body = "NUM_NODES=${SLURM_NNODES:-1}\nsrun torchrun --nnodes $NUM_NODES train.py\n"
    without = read(body, header="#!/bin/bash\n#SBATCH --gres=gpu:8\n").reading(Knob.NODES)
    with_directive = read(body).reading(Knob.NODES)
    assert (without.status, without.value) == (Status.RUNTIME, "${SLURM_NNODES:-1}")
    assert (with_directive.status, with_directive.value) == (Status.FOUND, "2")


def test_a_default_for_a_variable_of_the_users_own_is_still_the_value() -> None:
    body = "NODES=${MY_NODES:-3}\nsrun torchrun --nnodes $NODES train.py\n"
    reading = read(body, header="#!/bin/bash\n#SBATCH --gres=gpu:8\n").reading(Knob.NODES)
    assert (reading.status, reading.value) == (Status.FOUND, "3")
