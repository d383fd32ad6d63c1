"""`slurm-medic template ...` end to end on real files: import, show, set, render, diff."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon.cli import main
from daemon.importer import Form, Knob, analyse

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "data" / "sbatch"
EXAMPLES = ROOT.parent / "launch_templates"


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_import_show_set_render_diff(tmp_path: Path) -> None:
    code, output = invoke(
        "template", "import", str(DATA / "hf_run_clm.sbatch"),
        "--dialect", "hf", "--name", "clm", "--into", str(tmp_path),
    )  # fmt: skip
    assert code == 0, output
    assert "  per_device_train_batch_size  16: written at job.sbatch:24" in output
    assert "  optim                        not managed: slurm-medic does not read it" in output
    assert output.rstrip().endswith(
        "verdict: ready to manage: the global batch, micro-batch, accumulation and checkpoint "
        "are known"
    )
    directory = tmp_path / "clm"
    assert (directory / "job.sbatch").read_bytes() == (DATA / "hf_run_clm.sbatch").read_bytes()

    code, output = invoke("template", "render", str(directory))
    assert code == 0
    assert output == (DATA / "hf_run_clm.sbatch").read_text()

    code, output = invoke("template", "show", str(directory), "--json")
    assert code == 0, output
    shown = json.loads(output)
    assert (shown["global_batch"], shown["micro"], shown["accum"]) == (512, 16, 2)
    assert shown["knobs"]["optim"].startswith("not managed: ")
    [first] = shown["revisions"]

    code, output = invoke(
        "template", "set", str(directory), "per_device_train_batch_size=8",
        "gradient_accumulation_steps=4", "--reason", "true OOM at step 0",
    )  # fmt: skip
    assert code == 0, output
    assert "-    --per_device_train_batch_size 16 \\\n" in output
    assert "+    --per_device_train_batch_size 8 \\\n" in output
    assert "+    --gradient_accumulation_steps 4 \\\n" in output
    second = json.loads(invoke("template", "show", str(directory), "--json")[1])["revisions"]
    child = next(revision for revision in second if revision["parent"] == first["id"])
    assert (
        child["patch"]
        == "per_device_train_batch_size: 16 -> 8, gradient_accumulation_steps: 2 -> 4"
    )

    code, output = invoke("template", "render", str(directory), "--rev", child["id"][:6])
    assert code == 0
    assert "    --per_device_train_batch_size 8 \\\n" in output

    code, output = invoke("template", "diff", str(directory), first["id"], child["id"])
    assert code == 0
    assert output.startswith(f"--- clm@{first['id']}\n+++ clm@{child['id']}\n")

    code, output = invoke("template", "show", str(directory))
    assert "batch: global 512 = micro 16 x accum 2 x data-parallel 16" in output
    code, output = invoke("template", "set", str(directory), "optim=sgd", "--reason", "r")
    assert code == 1
    assert "optim is not managed in this template: " in output


def test_a_value_in_a_config_file_beside_the_script_is_managed_through_a_kept_copy(
    tmp_path: Path,
) -> None:
    source = tmp_path / "run"
    source.mkdir()
    for name in ("deepspeed_zero.sbatch", "ds_config.json"):
        shutil.copy(DATA / name, source / name)
    code, output = invoke(
        "template", "import", str(source / "deepspeed_zero.sbatch"), "--json",
        "--dialect", "deepspeed", "--name", "llama", "--into", str(tmp_path),
    )  # fmt: skip
    assert code == 0, output
    document = json.loads(output)
    knobs = {knob["knob"]: knob for knob in document["template"]["knobs"]}
    micro = knobs["train_micro_batch_size_per_gpu"]
    assert (micro["value"], micro["through_copy"]) == (4, ["ds_config.json"])
    assert micro["where"].startswith("written at ds_config.json:3 (through the template's copy")
    assert knobs["gradient_checkpointing"]["through_copy"] == []
    assert document["template"]["configs"] == [
        {
            "path": "ds_config.json",
            "copy": "configs/ds_config.json",
            "knobs": [
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "zero_stage",
            ],
            "not_usable": None,
        }
    ]
    assert document["verdict"]["ready"] is True
    directory = tmp_path / "llama"
    original = (DATA / "ds_config.json").read_bytes()
    assert (directory / "configs" / "ds_config.json").read_bytes() == original
    code, output = invoke("template", "render", str(directory))
    assert output == (DATA / "deepspeed_zero.sbatch").read_text()

    code, output = invoke(
        "template", "set", str(directory), "train_micro_batch_size_per_gpu=2",
        "gradient_accumulation_steps=4", "zero_stage=3", "--reason", "true OOM at step 0",
    )  # fmt: skip
    assert code == 0, output
    assert "-    --deepspeed_config ds_config.json \\\n" in output
    assert '+    --deepspeed_config "$HOME/.slurm-medic/' in output
    assert '+  "train_micro_batch_size_per_gpu": 2,\n' in output
    assert '+    "stage": 3,\n' in output
    assert "+SLURM_MEDIC_EOF\n" in output
    child = output.split()[1]
    code, script = invoke("template", "render", str(directory), "--rev", child)
    assert subprocess.run(["bash", "-n"], input=script.encode(), check=False).returncode == 0
    again = analyse(script, files={"ds_config.json": original.decode()})
    assert again.reading(Knob.MICRO_BATCH).value == "2"
    assert again.reading(Knob.ZERO_STAGE).value == "3"
    zero = again.reading(Knob.ZERO_STAGE).winner
    assert zero is not None
    assert zero.site is not None
    assert zero.site.within is Form.HEREDOC_LITERAL
    assert (source / "ds_config.json").read_bytes() == original  # the user's file is not written
    assert (directory / "configs" / "ds_config.json").read_bytes() == original

    code, output = invoke("template", "show", str(directory))
    assert code == 0, output
    assert (
        "config ds_config.json kept as configs/ds_config.json: train_micro_batch_size_per_gpu,"
        " gradient_accumulation_steps, zero_stage managed through the copy" in output
    )


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
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes").write_text("mine")
    code, output = invoke(
        "template", "import", str(DATA / "hf_run_clm.sbatch"),
        "--dialect", "hf", "--name", "taken", "--into", str(tmp_path),
    )  # fmt: skip
    assert code == 1
    assert "already exists and is not empty: not overwritten" in output
    assert sorted(path.name for path in (tmp_path / "taken").iterdir()) == ["notes"]


def test_a_template_named_relative_to_the_current_directory_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(EXAMPLES / "hf-trainer", tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(main, ["template", "show", "hf"])
    assert shown.exit_code == 0, shown.output
    assert "hf-trainer-example" in shown.output
    rendered = CliRunner().invoke(main, ["template", "render", "hf"])
    assert rendered.exit_code == 0, rendered.output
    assert "--per_device_train_batch_size 4" in rendered.output


def _hostile_template(tmp_path: Path) -> Path:
    """The HF example named with a terminal title sequence, its output directory holding one
    that would clear the screen and a right-to-left override."""
    directory = tmp_path / "hf"
    shutil.copytree(EXAMPLES / "hf-trainer", directory)
    toml = directory / "template.toml"
    text = toml.read_text().replace(
        'name = "hf-trainer-example"', 'name = "hf\\u001b]0;pwned\\u0007"'
    )
    text = text.replace(
        'output_dir = "/tmp/slurm-medic-examples/hf"', 'output_dir = "/tmp/hf\\u001b[2J\\u202e"'
    )
    toml.write_text(text)
    return directory


def test_show_set_and_diff_print_the_templates_own_text_escaped_and_render_keeps_it(
    tmp_path: Path,
) -> None:
    directory = _hostile_template(tmp_path)
    shown = CliRunner().invoke(main, ["template", "show", str(directory)])
    assert shown.exit_code == 0, shown.output
    assert shown.output.startswith("hf\\x1b]0;pwned\\x07  (Hugging Face")
    as_json = CliRunner().invoke(main, ["template", "show", str(directory), "--json"])
    assert json.loads(as_json.output)["name"] == "hf\x1b]0;pwned\x07"
    for output in (shown.output, as_json.output):
        assert "\x1b" not in output
        assert "\x07" not in output

    changed = CliRunner().invoke(
        main,
        ["template", "set", str(directory), "per_device_train_batch_size=2", "--reason", "r"],
    )
    assert changed.exit_code == 0, changed.output
    [first, second] = [
        revision["id"]
        for revision in json.loads(invoke("template", "show", str(directory), "--json")[1])[
            "revisions"
        ]
    ]
    diff = CliRunner().invoke(main, ["template", "diff", str(directory), first, second])
    assert diff.exit_code == 0, diff.output
    assert diff.output.startswith(f"--- hf\\x1b]0;pwned\\x07@{first}\n")
    for output in (changed.output, diff.output):
        assert "\x1b" not in output
        assert "\u202e" not in output
        assert "--output_dir '/tmp/hf\\x1b[2J\\u202e' \\\n" in output  # a context line

    rendered = CliRunner().invoke(main, ["template", "render", str(directory)])
    assert rendered.exit_code == 0
    assert "--output_dir '/tmp/hf\x1b[2J\u202e' \\\n" in rendered.output  # the script itself


def test_a_template_error_quoting_its_own_text_is_one_escaped_line(tmp_path: Path) -> None:
    directory = _hostile_template(tmp_path)
    toml = directory / "template.toml"
    toml.write_text(
        toml.read_text().replace("dataloader_num_workers = 4", "dataloader_num_workers = -1")
    )
    broken = CliRunner().invoke(main, ["template", "show", str(directory)])
    assert broken.exit_code == 1
    assert broken.stderr.startswith("Error: template hf\\x1b]0;pwned\\x07: ")
    assert "\x1b" not in broken.stderr
    missing = CliRunner().invoke(
        main, ["template", "analyse", str(tmp_path / "gone\x1b[2J.sbatch")]
    )
    assert missing.exit_code == 3
    assert missing.stderr.startswith("slurm-medic template analyse: ")
    assert "gone\\x1b[2J.sbatch" in missing.stderr
    assert "\x1b" not in missing.stderr
