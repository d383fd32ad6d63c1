"""Imported templates: the user's script kept byte for byte, knobs managed only where the script
writes them, changes spliced at their places and read back, everything else refused in words.

The round trip is held on every script of the real corpus (tests/data/real/sbatch)."""

from __future__ import annotations

import difflib
import functools
import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.dialects.base import KnobKind
from daemon.imported import COPY_DELIMITER, IMPORTED_SCRIPT, Writing, config_copies, elsewhere_of
from daemon.imported_render import COPY_ROOT, write_value
from daemon.importer import Analysis, Form, Knob, Site, Status, analyse
from daemon.importer.readings import INT_KNOBS
from daemon.templates.model import LaunchTemplate, TemplateError
from daemon.templates.reading import parse_template
from daemon.templates.rendering import render
from daemon.templates.revisions import KnobChange, Patch, apply_patch, initial_revision
from remediators.allocator import ExpandableSegments, GarbageCollectionThreshold
from remediators.micro_batch import MicroBatchDown
from remediators.workers import WorkersDown
from tests.importer_corpus import (
    NOTED_MAPPINGS,
    ScriptLabel,
    analyse_script,
    load_labels,
    read_text,
)

LABELS = load_labels()
DIALECT_OF = {"hf": "hf", "megatron": "megatron", "deepspeed": "deepspeed"}  # others: torchrun
HEADER = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gres=gpu:4\n"


def imported(
    text: str, dialect: str = "hf", _configs: dict[str, str] | None = None, **document: object
) -> LaunchTemplate:
    base = {"name": "t", "dialect": dialect, "script": IMPORTED_SCRIPT, "imported": True}
    return parse_template({**base, **document}, text, configs=_configs)


@functools.cache
def corpus_template(file: str, dialect: str) -> LaunchTemplate:
    mapping = {flag: knob.value for flag, knob in NOTED_MAPPINGS.get(file, {}).items()}
    return imported(read_text(file), dialect, knob_names=mapping)


def dialect_for(label: ScriptLabel) -> str:
    return DIALECT_OF.get(label.dialect, "torchrun")


def moved(template: LaunchTemplate, knob: str) -> int:
    value = template.knobs[knob]
    assert isinstance(value, int)
    maximum = template.dialect.spec(knob).maximum
    return value - 1 if maximum is not None and value + 3 > maximum else value + 3


def changed_lines(before: str, after: str) -> set[int]:
    lines: set[int] = set()
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines())
    for tag, first, last, _, _ in matcher.get_opcodes():
        if tag != "equal":
            lines.update(range(first + 1, last + 1))
    return lines


# ---------------------------------------------------------------- the real corpus


@pytest.mark.parametrize("label", LABELS, ids=lambda label: label.file[:3])
def test_every_real_script_renders_back_to_its_own_bytes(label: ScriptLabel) -> None:
    template = corpus_template(label.file, dialect_for(label))
    original = (label_path := read_text(label.file)).encode("utf-8", "surrogateescape")
    script = render(template)
    assert script.encode("utf-8", "surrogateescape") == original
    assert initial_revision(template).script == label_path


def moves_another_reading(template: LaunchTemplate, knob: str, after: int) -> bool:
    """Whether writing `after` at the knob's own places changes what another knob reads (a
    run-time checkpoint path built on `$SLURM_JOB_NUM_NODES`, which `--nodes` sets)."""
    assert template.imported is not None
    managed = template.imported.managed[knob]
    text = template.imported.text
    for site in sorted(managed.sites, key=lambda site: site.start, reverse=True):
        text = text[: site.start] + write_value(after, site) + text[site.end :]
    again = analyse(text, name=IMPORTED_SCRIPT, knob_names=template.imported.knob_names)
    before = template.imported.analysis
    return any(
        reading.value != before.reading(reading.knob).value
        for reading in again.knobs
        if reading.knob is not managed.source
    )


@pytest.mark.parametrize("label", LABELS, ids=lambda label: label.file[:3])
def test_moving_a_managed_number_changes_only_its_places(label: ScriptLabel) -> None:
    template = corpus_template(label.file, dialect_for(label))
    assert template.imported is not None
    first = initial_revision(template)
    for knob, managed in template.imported.managed.items():
        spec = template.dialect.spec(knob)
        if managed.writing is not Writing.SITES or spec.kind is not KnobKind.INT:
            continue
        assert managed.source in INT_KNOBS
        after = moved(template, knob)
        patch = Patch((KnobChange(knob, template.knobs[knob], after),), "test")
        if moves_another_reading(template, knob, after):
            # Another value is built on this one: the change would move it too, so it is
            # refused rather than written.
            with pytest.raises(TemplateError, match="moved"):
                apply_patch(template, first, patch)
            continue
        revision = apply_patch(template, first, patch)
        assert changed_lines(first.script, revision.script) == {
            site.line.number for site in managed.sites
        }, knob
        again = analyse(
            revision.script, name=IMPORTED_SCRIPT, knob_names=NOTED_MAPPINGS.get(label.file)
        )
        assert again.reading(managed.source).value == str(after), knob
        for reading in again.knobs:  # nothing else moved
            if reading.knob is not managed.source:
                assert reading.value == template.imported.analysis.reading(reading.knob).value


@pytest.mark.parametrize("label", LABELS, ids=lambda label: label.file[:3])
def test_a_knob_that_is_not_managed_is_never_changed(label: ScriptLabel) -> None:
    template = corpus_template(label.file, dialect_for(label))
    first = initial_revision(template)
    for knob, why in template.not_managed.items():
        spec = template.dialect.spec(knob)
        if spec.kind is not KnobKind.INT:
            continue
        value = template.knobs[knob]
        assert isinstance(value, int)
        patch = Patch((KnobChange(knob, value, value + 1),), "test")
        with pytest.raises(TemplateError, match=f"{knob} is not managed in this template: "):
            apply_patch(template, first, patch)
        assert why


def test_the_corpus_has_managed_and_unmanaged_knobs_of_every_kind() -> None:
    managed = not_managed = 0
    for label in LABELS:
        template = corpus_template(label.file, dialect_for(label))
        assert template.imported is not None
        managed += len(template.imported.managed)
        not_managed += len(template.not_managed)
    assert managed > 5 * len(LABELS)
    assert not_managed > 0


# ---------------------------------------------------------------- managed, and why not


def test_a_value_in_a_variable_is_managed_at_its_assignment() -> None:
    text = HEADER + "MBS=4\nsrun python train.py --per_device_train_batch_size $MBS \\\n"
    text += "    --gradient_accumulation_steps 2\n"
    template = imported(text)
    assert template.knobs["per_device_train_batch_size"] == 4
    assert template.knobs["gpus_per_node"] == 4
    assert render(template, {**template.knobs, "per_device_train_batch_size": 2}) == text.replace(
        "MBS=4", "MBS=2"
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("srun python train.py --per_device_train_batch_size $1\n", "set at run time"),
        ("srun python train.py --per_device_train_batch_size auto\n", "cannot take"),
        ("srun python train.py\n", "not set by the script"),
        (
            "BS=8\nsrun python train.py --per_device_train_batch_size $BS "
            "--per_device_eval_batch_size $BS\n",
            "written at the same place as eval_batch",
        ),
    ],
)
def test_a_micro_batch_the_script_does_not_write_is_not_managed(body: str, reason: str) -> None:
    template = imported(HEADER + body)
    assert reason in template.not_managed["per_device_train_batch_size"]
    diagnosis = Diagnosis(FailureKind.TRUE_OOM, Confidence.HIGH, ("test",), onset=Onset.STEP0)
    applicability = MicroBatchDown().applies(diagnosis, template)
    assert not applicability
    assert "not managed in this template" in applicability.reason


def test_a_value_in_a_config_file_is_not_managed() -> None:
    text = HEADER + "srun python train.py --deepspeed ds.json --per_device_train_batch_size 4\n"
    template = imported(text, not_managed={"micro_batch": "also in ds.json (line 2)"})
    assert template.not_managed["per_device_train_batch_size"] == "also in ds.json (line 2)"


def test_show_json_and_patch_refusals_name_the_reason(tmp_path: object) -> None:
    template = imported(HEADER + "srun python train.py --per_device_train_batch_size 4\n")
    first = initial_revision(template)
    patch = Patch((KnobChange("optim", "", "sgd"),), "t")
    with pytest.raises(TemplateError, match="optim is not managed in this template: "):
        apply_patch(template, first, patch)
    with pytest.raises(TemplateError, match="optim is not managed"):
        render(template, {**template.knobs, "optim": "sgd"})


def test_an_imported_toml_may_not_carry_knob_values() -> None:
    with pytest.raises(TemplateError, match="knobs not allowed"):
        imported(HEADER + "python train.py\n", knobs={"nodes": 3})


# ---------------------------------------------------------------- insertions


def test_resume_goes_before_a_pipe_and_exports_after_the_header() -> None:
    text = HEADER + "srun python train.py --per_device_train_batch_size 4 2>&1 | tee log\n"
    template = imported(text)
    knobs = {
        **template.knobs,
        "resume_from_checkpoint": "/ck/checkpoint-100",
        "env": (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),),
        "exclude": ("gpu-03",),
    }
    assert render(template, knobs) == (
        HEADER
        + "#SBATCH --exclude=gpu-03\nexport PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n"
        "srun python train.py --per_device_train_batch_size 4 "
        "--resume_from_checkpoint /ck/checkpoint-100 2>&1 | tee log\n"
    )


DEEPSPEED_HEREDOC = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --gres=gpu:8
#SBATCH -x gpu-[01-02]
export PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:256'
cat <<EOT > ds_config.json
{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "zero_optimization": {"stage": 2}
}
EOT
srun deepspeed train.py --deepspeed ds_config.json --save_dir /ck/run &> log.txt"""


def test_a_deepspeed_heredoc_script_keeps_its_config_in_place_and_resumes_before_the_redirect() -> (
    None
):
    template = imported(DEEPSPEED_HEREDOC, "deepspeed")
    assert template.knobs["train_micro_batch_size_per_gpu"] == 4
    assert template.knobs["zero_stage"] == 2
    assert template.knobs["exclude"] == ("gpu-01", "gpu-02")
    assert template.checkpoint == CheckpointSpec(CheckpointLayout.DEEPSPEED, "/ck/run")
    knobs = {
        **template.knobs,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "zero_stage": 3,
        "load_dir": "/ck/run",
        "load_tag": "global_step100",
        "exclude": ("gpu-01", "gpu-02", "gpu-07"),
        "env": (("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256,expandable_segments:True"),),
    }
    script = render(template, knobs)
    assert script.endswith(
        "--save_dir /ck/run --load_dir /ck/run --ckpt_tag global_step100 &> log.txt"
    )
    assert '"train_micro_batch_size_per_gpu": 2,' in script
    assert '{"stage": 3}' in script
    assert "#SBATCH -x gpu-01,gpu-02,gpu-07\n" in script
    assert "ALLOC_CONF='max_split_size_mb:256,expandable_segments:True'\n" in script
    assert changed_lines(DEEPSPEED_HEREDOC, script) == {4, 5, 8, 9, 10, 13}


def test_a_presence_flag_is_never_removed() -> None:
    template = imported(HEADER + "srun python t.py --gradient_checkpointing\n")
    assert template.knobs["gradient_checkpointing"] is True
    with pytest.raises(TemplateError, match="does not remove flags"):
        render(template, {**template.knobs, "gradient_checkpointing": False})


def test_no_place_to_resume_means_resume_is_not_managed() -> None:
    template = imported(HEADER + "srun bash -c $'python train.py --x\\t1'\n")
    assert "no place to add a flag" in template.not_managed["resume_from_checkpoint"]


def test_bytes_crlf_and_a_missing_final_newline_come_back_unchanged() -> None:
    raw = b"#!/bin/bash\r\n#SBATCH --nodes=2\r\n# caf\xe9\r\n"
    raw += b"srun python t.py --per_device_train_batch_size 4"
    text = raw.decode("utf-8", "surrogateescape")
    template = imported(text)
    assert render(template).encode("utf-8", "surrogateescape") == raw
    moved_script = render(template, {**template.knobs, "per_device_train_batch_size": 2})
    assert moved_script.encode("utf-8", "surrogateescape") == raw[:-1] + b"2"


# ---------------------------------------------------------------- formatting by form


# Paths: the analysis reads a bare number or switch named like a directory as no directory.
PATHS = st.text(
    alphabet=st.sampled_from(list("abcXYZ019_./-:,=@ $\"'\\`!*?[]{}~#;&|<>()")), min_size=1
).map(lambda text: "/" + text.strip())
PATH_FORMS = {
    Form.SHELL_WORD: ("--output_dir {}", "/a"),
    Form.DOUBLE_QUOTED: ('--output_dir "{}"', "/a"),
    Form.SINGLE_QUOTED: ("--output_dir '{}'", "/a"),
}


def winning_site(analysis: Analysis, knob: Knob) -> Site:
    occurrence = analysis.reading(knob).winner
    assert occurrence is not None
    assert occurrence.site is not None
    return occurrence.site


@settings(max_examples=150, deadline=None)
@given(form=st.sampled_from(sorted(PATH_FORMS)), value=PATHS)
def test_a_path_written_in_any_shell_form_reads_back_as_itself(form: Form, value: str) -> None:
    line, seed = PATH_FORMS[form]
    text = HEADER + "srun python train.py " + line.format(seed) + " --bf16\n"
    site = winning_site(analyse(text), Knob.CHECKPOINT_DIR)
    assert site.form is form
    if form is Form.SINGLE_QUOTED and "'" in value:
        with pytest.raises(ValueError, match="cannot be written inside"):
            write_value(value, site)
        return
    spliced = text[: site.start] + write_value(value, site) + text[site.end :]
    reading = analyse(spliced).reading(Knob.CHECKPOINT_DIR)
    assert (reading.status, reading.value) == (Status.FOUND, value)


CONFIGS = {
    Form.JSON: ("cfg.json", '{{"per_device_train_batch_size": {}, "output_dir": {}}}\n'),
    Form.YAML: ("cfg.yaml", "per_device_train_batch_size: {}\noutput_dir: {}\n"),
}


@settings(max_examples=100, deadline=None)
@given(
    form=st.sampled_from(sorted(CONFIGS)),
    number=st.integers(1, 10**6),
    # The analysis reads a config scalar without decoding its escapes: none are generated.
    value=PATHS.filter(lambda path: '"' not in path and "\\" not in path),
    quoted=st.booleans(),
)
def test_values_written_in_a_config_form_read_back_as_themselves(
    form: Form, number: int, value: str, quoted: bool
) -> None:
    path, body = CONFIGS[form]
    seed_path = '"/a"' if quoted or form is Form.JSON else "/a"
    config = body.format(4, seed_path)
    script = HEADER + f"srun python train.py {path}\n"
    analysis = analyse(script, files={path: config})
    for knob, new in ((Knob.MICRO_BATCH, number), (Knob.CHECKPOINT_DIR, value)):
        site = winning_site(analysis, knob)
        assert site.form is form
        config = config[: site.start] + write_value(new, site) + config[site.end :]
        analysis = analyse(script, files={path: config})
        assert analysis.reading(knob).value == str(new), config
    assert json.dumps(analysis.reading(Knob.CHECKPOINT_DIR).value) == json.dumps(value)


def test_an_int_in_a_directive_and_a_heredoc_json_reads_back() -> None:
    template = imported(DEEPSPEED_HEREDOC, "deepspeed")
    script = render(template, {**template.knobs, "nodes": 16, "gpus_per_node": 4})
    analysis = analyse(script)
    assert analysis.reading(Knob.NODES).value == "16"
    assert analysis.reading(Knob.GPUS_PER_NODE).value == "4"


def test_levers_refuse_knobs_the_template_does_not_manage() -> None:
    text = HEADER + 'export PYTORCH_CUDA_ALLOC_CONF="$CONF"\nsrun python train.py --x 1\n'
    template = imported(text)
    diagnosis = Diagnosis(FailureKind.FRAGMENTATION, Confidence.HIGH, ("test",))
    for lever in (ExpandableSegments(), GarbageCollectionThreshold(), WorkersDown()):
        applicability = lever.applies(diagnosis, template)
        assert not applicability
        assert "is not managed in this template: " in applicability.reason, lever.name
    workers = imported(HEADER + "srun python train.py --dataloader_num_workers 8\n")
    assert WorkersDown().applies(diagnosis, workers)


# ---------------------------------------------------------------- config files the script names


def corpus_with_configs(label: ScriptLabel) -> tuple[LaunchTemplate, dict[str, str]]:
    """The script imported as `template import` does it, with the config files it names (the
    corpus files that stand for them) kept as copies; and those files, by the script's path."""
    texts = {path: read_text(corpus) for path, corpus in analyse_script(label).given.items()}
    text = read_text(label.file)
    analysis = analyse(text, name=IMPORTED_SCRIPT, files=texts)
    copies = config_copies(analysis, IMPORTED_SCRIPT, texts)
    kept = [copy.path for copy in copies]
    not_managed = elsewhere_of(analysis, IMPORTED_SCRIPT, kept)
    template = imported(
        text,
        dialect_for(label),
        configs={copy.path: copy.copy for copy in copies},
        not_managed={knob.value: why for knob, why in not_managed.items()},
        _configs={copy.copy: copy.text for copy in copies},
    )
    return template, texts


WITH_CONFIGS = [label for label in LABELS if label.config_files]


def bash_syntax_ok(script: str) -> bool:
    return (
        subprocess.run(
            ["bash", "-n"], input=script.encode("utf-8", "surrogateescape"), check=False
        ).returncode
        == 0
    )


@pytest.mark.parametrize("label", WITH_CONFIGS, ids=lambda label: label.file[:3])
def test_a_knob_in_a_config_file_moves_through_the_copy_the_script_writes(
    label: ScriptLabel,
) -> None:
    template, texts = corpus_with_configs(label)
    assert template.imported is not None
    assert render(template) == read_text(label.file)  # the user's own config stays in use
    first = initial_revision(template)
    for knob, managed in template.imported.managed.items():
        if not managed.through or template.dialect.spec(knob).kind is not KnobKind.INT:
            continue
        assert managed.source is not None
        after = moved(template, knob)
        revision = apply_patch(
            template, first, Patch((KnobChange(knob, template.knobs[knob], after),), "t")
        )
        assert bash_syntax_ok(revision.script), knob
        again = analyse(revision.script, name=IMPORTED_SCRIPT, files=texts)
        reading = again.reading(managed.source)
        assert reading.value == str(after), knob
        copied = [
            o.site
            for o in reading.occurrences
            if o.site and o.site.file == IMPORTED_SCRIPT and o.site.within is Form.HEREDOC_LITERAL
        ]
        assert copied, f"{knob} is not read from the heredoc copy"
        for other in again.knobs:  # nothing else moved
            if other.knob is not managed.source:
                assert other.value == template.imported.analysis.reading(other.knob).value, (
                    other.knob
                )
        assert f'+cat > "{COPY_ROOT}/' in revision.diff
        assert f"+{COPY_DELIMITER}\n" in revision.diff
        for path in managed.through:  # the kept copy is the original text: only the render moves
            assert template.imported.configs[path].config.text == texts[path]


def test_the_corpus_has_knobs_managed_through_config_copies_and_refusals_with_reasons() -> None:
    through: dict[str, list[str]] = {}
    refused: dict[str, str] = {}
    for label in WITH_CONFIGS:
        template, _ = corpus_with_configs(label)
        assert template.imported is not None
        for knob, managed in template.imported.managed.items():
            if managed.through:
                through.setdefault(label.file[:3], []).append(knob)
        for carried in template.imported.configs.values():
            if carried.why_not:
                refused[label.file[:3]] = carried.why_not
    assert {"005", "026", "027", "032", "033", "035", "037", "043"} <= set(through)
    assert sum(len(knobs) for knobs in through.values()) >= 25
    assert "per_device_train_batch_size" in through["027"]
    # ${ACCELERATE_DIR}/examples/... and /home/$USER/...: no single place names the file
    assert refused == {
        "007": "its path (--config_file) is assembled from pieces, not written in one place",
        "024": "its path (--config) is assembled from pieces, not written in one place",
    }


DS_CONFIG = """{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "zero_optimization": {"stage": 2}
}
"""


def deepspeed_by_path(launch: str, config: str = DS_CONFIG) -> LaunchTemplate:
    text = HEADER + launch
    analysis = analyse(text, name=IMPORTED_SCRIPT, files={"ds_config.json": config})
    copies = config_copies(analysis, IMPORTED_SCRIPT, {"ds_config.json": config})
    return imported(
        text,
        "deepspeed",
        configs={copy.path: copy.copy for copy in copies},
        _configs={copy.copy: copy.text for copy in copies},
    )


def test_micro_batch_and_zero_stage_in_a_json_named_through_a_variable() -> None:
    launch = "CFG=ds_config.json\nsrun deepspeed train.py --deepspeed_config $CFG --save /ck\n"
    template = deepspeed_by_path(launch)
    knobs = {
        **template.knobs,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "zero_stage": 3,
    }
    script = render(template, knobs)
    assert bash_syntax_ok(script)
    [directory] = {line.split('"')[1] for line in script.splitlines() if line.startswith("mkdir")}
    assert directory.startswith(f"{COPY_ROOT}/")
    assert f'CFG="{directory}/ds_config.json"\n' in script
    assert f"cat > \"{directory}/ds_config.json\" <<'{COPY_DELIMITER}' || exit 1\n" in script
    again = analyse(script, name=IMPORTED_SCRIPT, files={"ds_config.json": DS_CONFIG})
    for knob, value in ((Knob.MICRO_BATCH, "2"), (Knob.GRAD_ACCUM, "4"), (Knob.ZERO_STAGE, "3")):
        winner = again.reading(knob).winner
        assert winner is not None
        assert winner.site is not None
        assert (winner.value, winner.site.file, winner.site.within) == (
            value,
            IMPORTED_SCRIPT,
            Form.HEREDOC_LITERAL,
        )
    # the same change renders the same copy in the same place: a revision is reproducible
    assert render(template, knobs) == script


@pytest.mark.parametrize(
    ("launch", "why"),
    [
        (
            "srun deepspeed train.py --deepspeed_config 'ds_config.json'\n",
            "written as single_quoted text, where the copy's path cannot be written safely",
        ),
        (
            "D=.\nsrun deepspeed train.py --deepspeed_config $D/ds_config.json\n",
            "assembled from pieces, not written in one place",
        ),
    ],
)
def test_a_config_whose_path_cannot_name_the_copy_is_not_managed(launch: str, why: str) -> None:
    template = deepspeed_by_path(launch)
    assert why in template.not_managed["zero_stage"]
    first = initial_revision(template)
    with pytest.raises(TemplateError, match="zero_stage is not managed in this template: "):
        apply_patch(template, first, Patch((KnobChange("zero_stage", 2, 3),), "t"))


def test_a_config_that_holds_the_heredoc_delimiter_is_not_managed() -> None:
    config = DS_CONFIG.replace("{\n", '{\n  "comment": "' + COPY_DELIMITER + '",\n', 1)
    template = deepspeed_by_path(
        "srun deepspeed train.py --deepspeed_config ds_config.json\n", config
    )
    assert COPY_DELIMITER in template.not_managed["zero_stage"]
    with pytest.raises(TemplateError, match=f"not managed in this template: .*{COPY_DELIMITER}"):
        render(template, {**template.knobs, "zero_stage": 3})


def test_a_kept_config_must_be_a_plain_file_under_configs() -> None:
    text = HEADER + "srun deepspeed train.py --deepspeed_config ds_config.json\n"
    for copy in ("../ds_config.json", "configs/../x", "configs/.hidden", "ds_config.json"):
        with pytest.raises(TemplateError, match="not a configs/<name> file"):
            imported(text, "deepspeed", configs={"ds_config.json": copy}, _configs={copy: "{}"})
    with pytest.raises(TemplateError, match=r"config copy configs/ds_config\.json was not read"):
        imported(text, "deepspeed", configs={"ds_config.json": "configs/ds_config.json"})


def test_kept_configs_get_names_of_their_own_and_only_files_the_script_names() -> None:
    text = HEADER + (
        "srun deepspeed train.py --deepspeed_config a/ds.json\n"
        "srun deepspeed train.py --deepspeed_config 'b/ds.json'\n"
    )
    texts = {"a/ds.json": DS_CONFIG, "b/ds.json": DS_CONFIG, "c/unnamed.json": DS_CONFIG}
    analysis = analyse(text, name=IMPORTED_SCRIPT, files=texts)
    copies = config_copies(analysis, IMPORTED_SCRIPT, texts)
    assert [(copy.path, copy.copy) for copy in copies] == [
        ("a/ds.json", "configs/ds.json"),
        ("b/ds.json", "configs/2-ds.json"),
    ]
