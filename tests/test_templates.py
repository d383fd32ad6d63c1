"""Templates: loading, typed knobs, sandboxed rendering, patches and revisions."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from daemon import process
from daemon.dialects import DIALECTS, get_dialect
from daemon.dialects.base import KnobError
from daemon.templates.model import LaunchTemplate, TemplateError, parse_knob_text
from daemon.templates.reading import load_template, parse_template
from daemon.templates.rendering import render
from daemon.templates.revisions import (
    KnobChange,
    Patch,
    RevisionDir,
    apply_patch,
    diff_revisions,
    initial_revision,
    revision_from_json,
    revision_to_json,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "launch_templates"
# Each directory holding a template.toml (examples/ holds the README's script and log, no template).
EXAMPLE_DIRS = sorted(path.parent for path in EXAMPLES.glob("*/template.toml"))


def bash_syntax_ok(script: str) -> process.CommandResult:
    return process.run(["bash", "-n"], input_text=script, timeout=10)


@pytest.fixture
def hf() -> LaunchTemplate:
    return load_template(EXAMPLES / "hf-trainer")


def _document(**overrides: object) -> dict[str, object]:
    document: dict[str, object] = {
        "name": "t",
        "dialect": "torchrun",
        "knobs": {
            "nodes": 2,
            "gpus_per_node": 2,
            "exclude": [],
            "micro_batch": 4,
            "grad_accum": 2,
            "recompute": "none",
            "zero_stage": 0,
            "eval_batch": 0,
            "eval_accum": 0,
            "num_workers": -1,
            "seq_len": 0,
            "resume_from": "",
        },
        "vars": {"program": "train.py"},
    }
    document.update(overrides)
    return document


SCRIPT = "#!/bin/bash\n{{ sbatch_header }}\n{{ env_exports }}\nsrun {{ vars.program | sh }}\n"


@pytest.mark.parametrize("directory", EXAMPLE_DIRS, ids=lambda path: path.name)
def test_every_example_renders_to_a_script_bash_accepts(directory: Path) -> None:
    template = load_template(directory)
    script = render(template)
    result = bash_syntax_ok(script)
    assert result.ok, result.stderr
    assert script.startswith("#!/bin/bash\n#SBATCH --nodes=")
    assert "deploy/devcluster/emulated-train" in script


def test_every_dialect_has_an_example_and_a_complete_knob_map() -> None:
    dialects = {load_template(directory).dialect.name for directory in EXAMPLE_DIRS}
    assert dialects == set(DIALECTS)
    for dialect in DIALECTS.values():
        assert set(dialect.defaults) == {spec.name for spec in dialect.knobs}
        assert set(dialect.roles.values()) <= {spec.name for spec in dialect.knobs}
        assert dialect.invariant
        assert dialect.resume_note


def test_knob_values_are_checked_against_type_and_range() -> None:
    hf = get_dialect("hf")
    with pytest.raises(KnobError, match="below the minimum 1"):
        hf.spec("per_device_train_batch_size").validate(0)
    with pytest.raises(KnobError, match="expected an integer"):
        hf.spec("per_device_train_batch_size").validate(True)
    with pytest.raises(KnobError, match="not one of"):
        get_dialect("megatron").spec("recompute_granularity").validate("most")
    with pytest.raises(KnobError, match="control characters"):
        hf.spec("resume_from_checkpoint").validate("/ckpt\n; rm -rf /")
    with pytest.raises(KnobError, match="not a node name"):
        hf.spec("exclude").validate(["gpu-01", "gpu 02;reboot"])
    with pytest.raises(KnobError, match="not an environment variable name"):
        hf.spec("env").validate({"BAD-NAME": "x"})
    assert hf.spec("env").validate({"B": "2", "A": "1"}) == (("A", "1"), ("B", "2"))
    assert parse_knob_text(hf, "gradient_checkpointing", "True") is True
    assert parse_knob_text(hf, "exclude", "gpu-01,gpu-02") == ("gpu-01", "gpu-02")


def test_a_template_breaking_the_invariant_is_refused() -> None:
    megatron = load_template(EXAMPLES / "megatron")
    document = {
        "name": "m",
        "dialect": "megatron",
        "knobs": {**dict(megatron.knobs), "global_batch_size": 63, "exclude": []},
    }
    document["knobs"].pop("env")  # type: ignore[attr-defined]
    with pytest.raises(TemplateError, match="not a multiple of micro-batch 4 x data-parallel 4"):
        parse_template(document, SCRIPT.replace("vars.program | sh", "name | sh"))


def test_unknown_and_missing_knobs_are_named() -> None:
    document = _document()
    document["knobs"] = {**document["knobs"], "micro_batch_size": 3}  # type: ignore[dict-item]
    with pytest.raises(TemplateError, match="no knob\\(s\\) micro_batch_size"):
        parse_template(document, SCRIPT)
    document = _document()
    del document["knobs"]["grad_accum"]  # type: ignore[attr-defined]
    with pytest.raises(TemplateError, match="missing knob\\(s\\) grad_accum"):
        parse_template(document, SCRIPT)


def test_optional_knobs_may_be_left_out_and_are_then_unset() -> None:
    document = _document()
    for optional in ("eval_batch", "eval_accum", "num_workers", "seq_len"):
        del document["knobs"][optional]  # type: ignore[attr-defined]
    template = parse_template(document, SCRIPT)
    assert template.knobs["num_workers"] == -1
    assert template.knobs["seq_len"] == 0
    script = render(template)
    assert "NUM_WORKERS" not in script
    assert "SEQ_LEN" not in script
    assert "export MICRO_BATCH=4" in script


def test_undefined_names_are_errors_not_empty_strings() -> None:
    with pytest.raises(TemplateError, match="has no attribute 'program_typo'"):
        parse_template(_document(), SCRIPT.replace("vars.program", "vars.program_typo"))
    with pytest.raises(TemplateError, match="'programme' is undefined"):
        parse_template(_document(), SCRIPT.replace("vars.program", "programme"))


@pytest.mark.parametrize(
    "hostile", ["train.py; rm -rf ~", "$(reboot)", "a b", "`id`", "x\ny", "ünïcødé"]
)
def test_a_string_reaching_the_script_unquoted_is_refused(hostile: str) -> None:
    document = _document(vars={"program": hostile})
    with pytest.raises(TemplateError, match="use `\\| sh`"):
        parse_template(document, SCRIPT.replace("vars.program | sh", "vars.program"))


@pytest.mark.parametrize("hostile", ["train.py; rm -rf ~", "$(reboot)", "it's", "ünïcødé"])
def test_quoted_strings_arrive_as_one_literal_word(hostile: str) -> None:
    template = parse_template(_document(vars={"program": hostile}), SCRIPT)
    script = render(template)
    last = script.splitlines()[-1]
    echoed = process.run(
        ["bash", "-c", "set -- " + last.removeprefix("srun ") + '; printf "%s\\n" "$#" "$1"'],
        timeout=10,
    )
    assert echoed.stdout == f"1\n{hostile}\n"


def test_env_values_are_quoted_and_exported_verbatim() -> None:
    document = _document(env={"WANDB_NOTES": "a run; $(id) `x` it's"})
    script = render(parse_template(document, SCRIPT))
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    result = process.run(["bash", "-c", exports + '\nprintf "%s" "$WANDB_NOTES"'], timeout=10)
    assert result.stdout == "a run; $(id) `x` it's"


def test_the_sandbox_blocks_python_internals() -> None:
    script = "{{ ''.__class__.__mro__[1].__subclasses__() }}\n"
    with pytest.raises(TemplateError, match=r"line 1: a function or method call"):
        parse_template(_document(), script)
    with pytest.raises(TemplateError, match=r"the attribute `__class__`"):
        parse_template(_document(), "{{ ''.__class__ | sh }}\n")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"job-name": "my run"}, "only letters"),
        ({"job-name": "x\n#SBATCH --uid=0"}, "only letters"),
        ({"exclude": "gpu-01"}, "set by the knobs"),
        ({"Bad_Key": "1"}, "not an sbatch long option"),
    ],
)
def test_sbatch_options_that_would_need_quoting_are_refused(
    options: dict[str, str], message: str
) -> None:
    with pytest.raises(TemplateError, match=message):
        parse_template(_document(sbatch=options), SCRIPT)


def test_load_refuses_binary_and_escaping_scripts(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "hf-trainer", tmp_path / "t")
    (tmp_path / "t" / "job.sbatch.j2").write_bytes(b"#!/bin/bash\0\x00binary")
    with pytest.raises(TemplateError, match="not a script"):
        load_template(tmp_path / "t")
    toml = (tmp_path / "t" / "template.toml").read_text()
    (tmp_path / "t" / "template.toml").write_text(
        toml.replace('script = "job.sbatch.j2"', 'script = "../../etc/passwd"')
    )
    with pytest.raises(TemplateError, match="must be a file inside"):
        load_template(tmp_path / "t")
    (tmp_path / "t" / "template.toml").write_text("name = [unterminated")
    with pytest.raises(TemplateError, match="cannot read"):
        load_template(tmp_path / "t")


def test_a_patch_makes_a_child_revision_with_the_diff(hf: LaunchTemplate) -> None:
    first = initial_revision(hf)
    patch = Patch(
        (
            KnobChange("per_device_train_batch_size", 4, 2),
            KnobChange("gradient_accumulation_steps", 8, 16),
        ),
        "halve micro",
    )
    child = apply_patch(hf, first, patch)
    assert child.parent == first.id
    assert child.patch == patch
    assert child.knobs["per_device_train_batch_size"] == 2
    assert "--per_device_train_batch_size 2" in child.script
    changed = [line for line in child.diff.splitlines() if line[:1] in "+-"]
    assert changed == [
        f"--- hf-trainer-example@{first.id}",
        f"+++ hf-trainer-example@{child.id}",
        "-    --per_device_train_batch_size 4 \\",
        "-    --gradient_accumulation_steps 8 \\",
        "+    --per_device_train_batch_size 2 \\",
        "+    --gradient_accumulation_steps 16 \\",
    ]
    assert diff_revisions(first, child) == child.diff
    assert first.knobs["per_device_train_batch_size"] == 4  # the parent is untouched


def test_patches_are_refused_when_stale_empty_or_invalid(hf: LaunchTemplate) -> None:
    first = initial_revision(hf)
    with pytest.raises(TemplateError, match="expects per_device_train_batch_size=16"):
        apply_patch(hf, first, Patch((KnobChange("per_device_train_batch_size", 16, 4),), "x"))
    with pytest.raises(TemplateError, match="changes nothing"):
        apply_patch(hf, first, Patch((KnobChange("per_device_train_batch_size", 4, 4),), "x"))
    with pytest.raises(TemplateError, match="below the minimum"):
        apply_patch(hf, first, Patch((KnobChange("per_device_train_batch_size", 4, 0),), "x"))
    with pytest.raises(TemplateError, match="unknown knob"):
        apply_patch(hf, first, Patch((KnobChange("batch", 4, 2),), "x"))


def test_a_patch_whose_lever_never_reaches_the_script_is_refused() -> None:
    megatron = load_template(EXAMPLES / "megatron")
    first = initial_revision(megatron)
    invisible = Patch((KnobChange("recompute_modules", (), ("mlp",)),), "modules without selective")
    with pytest.raises(TemplateError, match="the lever would never reach the job"):
        apply_patch(megatron, first, invisible)


def test_revision_ids_are_content_hashes(hf: LaunchTemplate) -> None:
    assert initial_revision(hf).id == initial_revision(hf).id
    other = dataclasses.replace(hf, knobs={**hf.knobs, "dataloader_num_workers": 2})
    assert initial_revision(other).id != initial_revision(hf).id


def test_revisions_round_trip_through_json_and_the_revisions_dir(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "torchrun", tmp_path / "t")
    template = load_template(tmp_path / "t")
    store = RevisionDir(template)
    first = store.head()
    patch = Patch(
        (KnobChange("env", template.knobs["env"], (("PYTORCH_ALLOC_CONF", "x:1"),)),), "env"
    )
    child = apply_patch(template, first, patch)
    store.save(child)
    assert revision_from_json(template.dialect, revision_to_json(child)) == child
    assert store.load(child.id[:8]) == child
    assert store.head() == child
    assert [revision.id for revision in store.all()] == sorted([first.id, child.id])
    damaged = json.loads((store.path / f"{child.id}.json").read_text())
    damaged["knobs"]["micro_batch"] = 0
    (store.path / f"{child.id}.json").write_text(json.dumps(damaged))
    with pytest.raises(TemplateError, match="damaged revision"):
        store.load(child.id)
    with pytest.raises(TemplateError, match="not a revision id"):
        store.load("../../etc")


def test_deepspeed_config_cannot_end_its_heredoc_early() -> None:
    template = load_template(EXAMPLES / "deepspeed")
    hostile = dataclasses.replace(
        template, config_base={"comment": "x\nMEDIC_DS_CONFIG\nrm -rf /\n"}
    )
    script = render(hostile)
    assert script.splitlines().count("MEDIC_DS_CONFIG") == 1
    start = script.index("<<'MEDIC_DS_CONFIG'\n") + len("<<'MEDIC_DS_CONFIG'\n")
    config = json.loads(script[start : script.index("\nMEDIC_DS_CONFIG\n")])
    assert config["comment"] == "x\nMEDIC_DS_CONFIG\nrm -rf /\n"
    assert config["train_batch_size"] == 4 * 8 * 2 * 2
