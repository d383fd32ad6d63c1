"""`slurm-medic template ...` end to end on real files: import, show, set, render, diff."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from daemon.cli import main

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "data" / "sbatch"
EXAMPLES = ROOT.parent / "launch_templates"


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_import_show_set_render_diff(tmp_path: Path) -> None:
    code, output = invoke(
        "template", "import", str(DATA / "deepspeed_zero.sbatch"),
        "--dialect", "deepspeed", "--name", "llama", "--into", str(tmp_path),
    )  # fmt: skip
    assert code == 0, output
    assert (
        "zero_stage = 2  (line 12: --deepspeed_config ds_config.json: zero_optimization.stage)"
        in output
    )
    assert "not in the script, defaulted: exclude, offload_param, load_dir, load_tag" in output
    assert "kept verbatim: export MASTER_ADDR=$(scontrol" in output
    directory = tmp_path / "llama"

    code, output = invoke("template", "show", str(directory), "--json")
    assert code == 0, output
    shown = json.loads(output)
    assert (shown["global_batch"], shown["micro"], shown["accum"]) == (64, 4, 2)
    [first] = shown["revisions"]

    code, output = invoke(
        "template", "set", str(directory), "train_micro_batch_size_per_gpu=2",
        "gradient_accumulation_steps=4", "--reason", "true OOM at step 0",
    )  # fmt: skip
    assert code == 0, output
    assert '-  "train_micro_batch_size_per_gpu": 4,' in output
    assert '+  "train_micro_batch_size_per_gpu": 2,' in output
    second = json.loads(invoke("template", "show", str(directory), "--json")[1])["revisions"]
    child = next(revision for revision in second if revision["parent"] == first["id"])
    assert child["patch"] == (
        "train_micro_batch_size_per_gpu: 4 -> 2, gradient_accumulation_steps: 2 -> 4"
    )

    code, output = invoke("template", "render", str(directory), "--rev", child["id"][:6])
    assert code == 0
    assert '"train_batch_size": 64,' in output

    code, output = invoke("template", "diff", str(directory), first["id"], child["id"])
    assert code == 0
    assert output.startswith(f"--- llama@{first['id']}\n+++ llama@{child['id']}\n")
    assert '+  "gradient_accumulation_steps": 4,' in output

    code, output = invoke("template", "show", str(directory))
    assert "batch: global 64 = micro 4 x accum 2 x data-parallel 8" in output


def test_cli_errors_are_clear(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "hf-trainer", tmp_path / "hf")
    code, output = invoke("template", "set", str(tmp_path / "hf"), "optim=sgdx", "--reason", "r")
    assert code == 1
    assert "'sgdx' is not one of" in output
    code, output = invoke("template", "set", str(tmp_path / "hf"), "micro=2", "--reason", "r")
    assert code == 1
    assert "no knob 'micro'" in output
    code, output = invoke("template", "diff", str(tmp_path / "hf"), "abcd", "ef01")
    assert code == 1
    assert "no revision(s) match 'abcd'" in output
    code, output = invoke(
        "template", "import", str(DATA / "hf_run_clm.sbatch"),
        "--dialect", "hf", "--name", "../escape", "--into", str(tmp_path),
    )  # fmt: skip
    assert code == 2
    assert "letters, digits" in output
    code, output = invoke(
        "template", "import", str(DATA / "hf_run_clm.sbatch"),
        "--dialect", "megatron", "--name", "wrong", "--into", str(tmp_path),
    )  # fmt: skip
    assert code == 1
    assert "no launch line with Megatron-LM / NeMo flags" in output
    assert not (tmp_path / "wrong").exists()
