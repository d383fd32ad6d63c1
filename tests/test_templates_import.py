"""Importing real-looking sbatch scripts of each dialect: what is recognised, what is kept."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import process
from daemon.templates import (
    ImportResult,
    KnobChange,
    Patch,
    TemplateError,
    apply_patch,
    import_script,
    initial_revision,
    render,
)

DATA = Path(__file__).resolve().parent / "data" / "sbatch"


def imported(name: str, dialect: str) -> ImportResult:
    return import_script(
        (DATA / name).read_text(),
        dialect_name=dialect,
        name=name.partition(".")[0],
        read_file=lambda path: (DATA / path).read_text(),
    )


def recognised(result: ImportResult) -> dict[str, object]:
    return {item.knob: item.value for item in result.recognised if item.knob != "env"}


def bash_ok(script: str) -> bool:
    return process.run(["bash", "-n"], input_text=script, timeout=10).ok


def test_hf_run_clm() -> None:
    result = imported("hf_run_clm.sbatch", "hf")
    assert recognised(result) == {
        "nodes": 2,
        "gpus_per_node": 8,
        "exclude": ("gpu-07", "gpu-08"),
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 32,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": True,
        "dataloader_num_workers": 8,
        "eval_accumulation_steps": 4,
    }
    assert result.template.knobs["env"] == (
        ("OMP_NUM_THREADS", "8"),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"),
        ("WANDB_PROJECT", "clm-ablation"),
    )
    assert result.defaulted == (
        "optim",
        "generation_max_length",
        "max_seq_length",
        "resume_from_checkpoint",
    )
    assert result.kept == (
        "line 10: #SBATCH comment kept verbatim (value needs quoting)",
        "kept verbatim: module load cuda/12.1",
        'kept verbatim: source "$HOME/venvs/hf/bin/activate"',
        "kept verbatim: export HF_HOME=/scratch/$USER/hf",
        'kept verbatim: echo "done: $SLURM_JOB_ID"',
    )
    script = render(result.template)
    assert bash_ok(script)
    assert '#SBATCH --comment="fine-tune run for the wiki ablation"' in script
    assert "#SBATCH --exclude=gpu-07,gpu-08" in script
    assert '--output_dir /scratch/alice/clm-gpt2 --report_to "$REPORT_TO"' in script
    assert "--optim" not in script  # never set, never added
    assert "--max_seq_length" not in script
    assert result.template.checkpoint is not None
    assert result.template.checkpoint.root == "/scratch/alice/clm-gpt2"
    assert result.template.dialect.geometry(result.template.knobs).global_batch == 16 * 2 * 16


def test_megatron_pretrain_gpt() -> None:
    result = imported("megatron_gpt.sbatch", "megatron")
    assert recognised(result) == {
        "nodes": 4,
        "gpus_per_node": 8,
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "seq_length": 2048,
        "micro_batch_size": 4,
        "global_batch_size": 512,
        "recompute_granularity": "selective",
        "use_distributed_optimizer": True,
        "num_workers": 4,
    }
    assert result.notes == ("line 18: --load: value is a shell expansion, kept verbatim",)
    script = render(result.template)
    assert bash_ok(script)
    assert '--load "$CKPT" --log-interval 10' in script
    assert "#SBATCH --exclusive\n" in script
    assert "#SBATCH --job-name=gpt-1.3b" in script
    geometry = result.template.dialect.geometry(result.template.knobs)
    assert (geometry.data_parallel, geometry.accum) == (8, 16)


def test_deepspeed_with_its_config_file() -> None:
    result = imported("deepspeed_zero.sbatch", "deepspeed")
    assert recognised(result) == {
        "nodes": 2,
        "gpus_per_node": 4,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_stage": 2,
        "offload_optimizer": "none",
        "gradient_checkpointing": True,
        "num_workers": 2,
    }
    script = render(result.template)
    assert bash_ok(script)
    start = script.index("<<'MEDIC_DS_CONFIG'\n") + len("<<'MEDIC_DS_CONFIG'\n")
    config = json.loads(script[start : script.index("\nMEDIC_DS_CONFIG\n")])
    original = json.loads((DATA / "ds_config.json").read_text())
    assert config["optimizer"] == original["optimizer"]
    assert config["zero_optimization"]["reduce_bucket_size"] == 500000000
    assert config["zero_optimization"]["stage"] == 2
    assert config["train_batch_size"] == original["train_batch_size"] == 4 * 2 * 8
    assert "ds_config.json" not in script
    assert '--deepspeed_config "$DS_CONFIG"' in script


def test_torchrun_with_environment_knobs() -> None:
    result = imported("torchrun_env.sbatch", "torchrun")
    assert recognised(result) == {
        "nodes": 2,
        "gpus_per_node": 8,
        "micro_batch": 32,
        "grad_accum": 4,
        "recompute": "none",
        "num_workers": 12,
        "eval_batch": 64,
    }
    script = render(result.template)
    assert bash_ok(script)
    assert 'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 8' in script
    assert (
        '--rdzv_endpoint "$RDZV_HOST:29500" train_vit.py --config configs/vit_large.yaml' in script
    )
    assert "export SEQ_LEN" not in script  # the script never set it
    assert result.template.checkpoint is not None
    assert result.template.checkpoint.root == "/scratch/carol/vit-l"


def test_an_imported_template_patches_to_a_one_knob_diff() -> None:
    result = imported("hf_run_clm.sbatch", "hf")
    first = initial_revision(result.template)
    patch = Patch((KnobChange("dataloader_num_workers", 8, 4),), "host RAM")
    child = apply_patch(result.template, first, patch)
    changed = [line for line in child.diff.splitlines()[2:] if line[:1] in "+-"]
    assert changed == ["-    --dataloader_num_workers 8", "+    --dataloader_num_workers 4"]


def test_jinja_syntax_in_a_script_is_carried_as_text() -> None:
    text = (
        (DATA / "hf_run_clm.sbatch")
        .read_text()
        .replace('echo "done: $SLURM_JOB_ID"', 'echo "{{ not a template }} {% raw %}"')
    )
    result = import_script(text, dialect_name="hf", name="t")
    assert 'echo "{{ not a template }} {% raw %}"' in render(result.template)
    with pytest.raises(TemplateError, match="endraw"):
        import_script(text + "echo '{% endraw %}'\n", dialect_name="hf", name="t")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("#SBATCH -N 2-4", "must be one fixed count"),
        ("#SBATCH --gres=gpu:a100:8,shard:2", "is not one GPU count per node"),
        ("#SBATCH --exclude=gpu-[01", "exclude list"),
        # Ten million names: refused by count, never expanded.
        ("#SBATCH --exclude=n[0-9999999]", "exclude list"),
    ],
)
def test_sbatch_options_a_knob_owns_must_be_understood(line: str, message: str) -> None:
    text = f"#!/bin/bash\n{line}\nsrun python train.py --per_device_train_batch_size 2\n"
    with pytest.raises(TemplateError, match=message):
        import_script(text, dialect_name="hf", name="t")


def test_scripts_that_cannot_be_imported_say_why() -> None:
    hidden = '#!/bin/bash\nOPTS="--micro-batch-size 4"\nsrun python pretrain_gpt.py $OPTS\n'
    with pytest.raises(TemplateError, match="shell variable"):
        import_script(hidden, dialect_name="megatron", name="t")
    with pytest.raises(TemplateError, match="binary"):
        import_script("#!/bin/bash\0", dialect_name="hf", name="t")
    with pytest.raises(Exception, match="unknown dialect"):
        import_script("srun x", dialect_name="jax", name="t")


def test_a_bad_value_is_reported_and_defaulted_not_guessed() -> None:
    text = "#!/bin/bash\n#SBATCH -N 2\nsrun python train.py --per_device_train_batch_size many\n"
    result = import_script(text, dialect_name="hf", name="t")
    assert "per_device_train_batch_size" in result.defaulted
    assert any("'many' is not an integer" in note for note in result.notes)
    assert "--per_device_train_batch_size many" in render(result.template)


plain_lines = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\\"),
    max_size=60,
).filter(
    lambda line: (
        not line.lstrip().startswith(("export", "#SBATCH", "#!"))
        and "--" not in line
        and not {"srun", "torchrun"} & set(line.split())
    )
)


@settings(max_examples=150, deadline=None)
@given(before=st.lists(plain_lines, max_size=5), after=st.lists(plain_lines, max_size=5))
def test_property_import_loses_no_line_it_does_not_recognise(
    before: list[str], after: list[str]
) -> None:
    launch = "srun python train.py --per_device_train_batch_size 4 --seed 7"
    text = "\n".join(["#!/bin/bash", "#SBATCH --nodes=2", *before, launch, *after]) + "\n"
    if any(
        "endraw" in line and ("{{" in line or "{%" in line or "{#" in line)
        for line in text.splitlines()
    ):
        with pytest.raises(TemplateError, match="endraw"):
            import_script(text, dialect_name="hf", name="t")
        return
    result = import_script(text, dialect_name="hf", name="t")
    script = render(result.template)
    rendered_lines = script.splitlines()
    for line in before + after:
        if line.strip():
            assert line in rendered_lines
    assert "srun python train.py --seed 7 \\" in rendered_lines
    assert "    --per_device_train_batch_size 4 \\" in rendered_lines


def test_unrecognised_words_keep_their_quoting_exactly() -> None:
    launch = (
        "srun python train.py --per_device_train_batch_size 4 --literal '$HOME' "
        '--expanded "$RUN_DIR/x y" --escaped a\\ b --mixed "x"y\'$z\' # a comment'
    )
    result = import_script(f"#!/bin/bash\n{launch}\n", dialect_name="hf", name="t")
    script = render(result.template)
    assert (
        "srun python train.py --literal '$HOME' --expanded \"$RUN_DIR/x y\" "
        "--escaped a\\ b --mixed \"x\"y'$z' \\\n    --per_device_train_batch_size 4"
    ) in script
    words = process.run(
        [
            "bash",
            "-c",
            "set -- "
            + script.split("srun python train.py ", 1)[1].split(" \\\n")[0]
            + '; printf "%s|" "$@"',
        ],
        timeout=10,
        env={"PATH": "/usr/bin:/bin", "HOME": "/home/h", "RUN_DIR": "/r"},
    )
    assert words.stdout == "--literal|$HOME|--expanded|/r/x y|--escaped|a b|--mixed|xy$z|"


def argv_of(words: str) -> list[str]:
    result = process.run(
        ["bash", "-c", f'set -- {words}; printf "%s\\0" "$@"'], timeout=10, env={"PATH": "/bin"}
    )
    return result.stdout.split("\0")[:-1]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.text(
            alphabet=st.characters(blacklist_categories=("Cs", "Cc")),
            min_size=1,
            max_size=12,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_property_the_launch_argv_is_unchanged_but_for_the_knobs(values: list[str]) -> None:
    extra = " ".join(f"--opt{i} {shlex.quote(value)}" for i, value in enumerate(values))
    original = f"python train.py {extra} --per_device_train_batch_size 4"
    result = import_script(f"#!/bin/bash\nsrun {original}\n", dialect_name="hf", name="t")
    launch = render(result.template).split("\nsrun ", 1)[1].split(" \\\n")[0]
    expected = argv_of(original)
    assert argv_of(launch) == expected[:-2]
