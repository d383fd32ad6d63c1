"""`slurm-medic template analyse` on real scripts: the report a person reads before an import.

Each corpus script is copied into a directory of its own with its config files under the
paths it names (as on a cluster), and the expectations come from its labels. Hostile files
(a FIFO, a link to a root-only file, NUL bytes, a file over the cap) are refused and reported,
and what they hold never reaches the report.
"""

from __future__ import annotations

import json
import os
import posixpath
import pwd
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from daemon.cli import main
from daemon.commands.import_gather import (
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_ROUNDS,
    FileState,
    caller_reader,
    gather,
    read_script,
)
from daemon.commands.import_json import READY, report_document
from daemon.importer import Knob
from daemon.owner_files import Owner, OwnerReadRefused, Refusal
from daemon.owner_walk import RefusalKind
from tests.importer_corpus import (
    NOTED_MAPPINGS,
    SBATCH_DIR,
    KnobLabel,
    analyse_script,
    load_labels,
)
from tests.test_owner_files import SECRET, alice_owner, owned_dir

LABELS = {label.file[:3]: label for label in load_labels()}
DEEPSPEED_BESIDE = "012"  # verbatim; --deepspeed_config ds_config.json beside it
FROM_DOLLAR_1 = "045"  # the output directory is chosen by `case $1`
NO_CHECKPOINT = "006"  # the checkpoint path is hard-coded in the Python file
READY_HF = "025"  # TRL flags in a variable: micro-batch, accumulation and --output_dir written
OWN_FLAGS = "003"  # the script's own argparse flags in a bash array
TWO_HOPS = "020"  # runs launch.sh, which names the YAML that holds the batch
DOCUMENT = {
    "script",
    "submit_dir",
    "files",
    "knobs",
    "checkpoint",
    "launches",
    "insertions",
    "notes",
    "verdict",
}


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, ["template", "analyse", *args], catch_exceptions=False)


def place(tmp_path: Path, number: str, *, configs: bool = True) -> Path:
    """The corpus script as `job.sbatch` in a directory of its own, with (or without) the
    corpus files that stand for the relative paths it names, at those paths (an absolute path,
    in someone's home on the cluster it came from, stays missing)."""
    label = LABELS[number]
    directory = tmp_path / "submit"
    directory.mkdir()
    script = directory / "job.sbatch"
    shutil.copyfile(SBATCH_DIR / label.file, script)
    if configs:
        for path, corpus in analyse_script(label, NOTED_MAPPINGS.get(label.file)).given.items():
            if posixpath.isabs(path):
                continue
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SBATCH_DIR / corpus, directory / path)
    return script


def knob_label(number: str, knob: Knob) -> KnobLabel:
    found = LABELS[number].knob(knob)
    assert found is not None, (number, knob)
    return found


def quoted(output: str, word: str, file: str, text: str) -> bool:
    """The report quotes `text` as a line of `file` (`      word FILE:N: TEXT`)."""
    return any(
        line.startswith(f"      {word} {file}:") and line.endswith(f": {text}")
        for line in output.splitlines()
    )


def document(*args: str) -> dict[str, Any]:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def reading(doc: dict[str, Any], knob: Knob) -> dict[str, Any]:
    found: dict[str, Any] = next(item for item in doc["knobs"] if item["knob"] == knob.value)
    return found


# ------------------------------------------------------------------ real scripts


def test_a_deepspeed_config_beside_the_script_is_read_and_quoted(tmp_path: Path) -> None:
    script = place(tmp_path, DEEPSPEED_BESIDE)
    config = script.parent / "ds_config.json"
    label = knob_label(DEEPSPEED_BESIDE, Knob.GLOBAL_BATCH)

    result = invoke(str(script))

    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"  ds_config.json ({config}): read" in out
    assert f"  global_batch = {label.value}" in out
    assert "    wins: train_batch_size in ds_config.json (documented flag or key)" in out
    assert quoted(out, "written", "ds_config.json", label.line)
    nodes = knob_label(DEEPSPEED_BESIDE, Knob.NODES)
    assert quoted(out, "written", str(script), nodes.line)
    assert "  micro_batch: not managed in this template: not set by the script" in out
    assert "  accumulation: implied: the framework derives it from the global batch" in out
    assert out.splitlines()[-1] == (
        "verdict: not ready to manage: micro-batch not managed in this template"
        " (not set by the script); checkpoint unknown: pass --checkpoint-dir"
    )


def test_a_given_checkpoint_dir_completes_what_the_script_leaves_out(tmp_path: Path) -> None:
    script = place(tmp_path, DEEPSPEED_BESIDE)

    doc = document(str(script), "--checkpoint-dir", "/scratch/ckpt")

    assert doc["checkpoint"]["state"] == "given"
    assert doc["checkpoint"]["directory"] == "/scratch/ckpt"
    assert doc["verdict"]["missing"] == ["micro_batch"]
    assert doc["verdict"]["terms"]["checkpoint_dir"]["state"] == "given"


def test_a_value_chosen_by_dollar_1_is_set_at_run_time_never_guessed(tmp_path: Path) -> None:
    script = place(tmp_path, FROM_DOLLAR_1)
    label = knob_label(FROM_DOLLAR_1, Knob.CHECKPOINT_DIR)
    assert label.value == "runtime"

    result = invoke(str(script))

    out = result.stdout
    assert result.exit_code == 0, result.output
    assert "  checkpoint_dir: set at run time: $OUT" in out
    assert quoted(out, "written", str(script), label.line)
    section = out.split("Checkpoint directory\n")[1].splitlines()
    assert section[:2] == [
        "  unknown: pass --checkpoint-dir",
        "      the script: set at run time: arguments $OUT are only known at run time",
    ]
    micro = knob_label(FROM_DOLLAR_1, Knob.MICRO_BATCH)
    assert f"  micro_batch = {micro.value}" in out
    assert "checkpoint unknown: pass --checkpoint-dir" in out.splitlines()[-1]

    given = document(str(script), "--checkpoint-dir", "/scratch/seg")
    assert given["verdict"]["missing"] == ["global_batch"]
    assert given["checkpoint"]["reason"].endswith(
        "the script: set at run time: arguments $OUT are only known at run time"
    )


def test_a_checkpoint_dir_the_script_never_names_is_asked_for(tmp_path: Path) -> None:
    script = place(tmp_path, NO_CHECKPOINT)
    assert LABELS[NO_CHECKPOINT].knob(Knob.CHECKPOINT_DIR) is None

    result = invoke(str(script))

    out = result.stdout
    assert "  checkpoint_dir: not managed in this template: not set by the script" in out
    assert "Checkpoint directory\n  unknown: pass --checkpoint-dir\n" in out
    doc = document(str(script))
    assert doc["checkpoint"] == {
        "state": "unknown",
        "directory": None,
        "source": None,
        "line": None,
        "script_value": None,
        "reason": "not set by the script",
    }
    assert "checkpoint_dir" in doc["verdict"]["missing"]
    assert doc["verdict"]["ready"] is False


def test_a_script_that_writes_all_four_is_ready(tmp_path: Path) -> None:
    script = place(tmp_path, READY_HF)
    checkpoint = knob_label(READY_HF, Knob.CHECKPOINT_DIR)

    result = invoke(str(script))
    doc = document(str(script))

    assert result.stdout.splitlines()[-1] == f"verdict: {READY}"
    assert doc["verdict"] == {
        "ready": True,
        "text": READY,
        "missing": [],
        "terms": doc["verdict"]["terms"],
    }
    assert doc["verdict"]["terms"]["global_batch"]["state"] == "implied"
    assert doc["checkpoint"]["directory"] == checkpoint.value
    assert doc["checkpoint"]["line"]["text"] == checkpoint.line
    # the same knob set twice: the launch's copy wins, the other is a mirror that must agree
    accum = reading(doc, Knob.GRAD_ACCUM)
    assert [item["effect"] for item in accum["occurrences"]] == ["wins", "mirror"]
    # zero stage comes from `configs/$3.yaml`: run time, with the line that names it
    zero = reading(doc, Knob.ZERO_STAGE)
    assert zero["status"] == "runtime"
    written = zero["occurrences"][0]["written"]
    assert [line["text"] for line in written] == [knob_label(READY_HF, Knob.ZERO_STAGE).line]


def test_a_config_two_hops_away_is_read_in_a_later_round(tmp_path: Path) -> None:
    script = place(tmp_path, TWO_HOPS)
    micro = knob_label(TWO_HOPS, Knob.MICRO_BATCH)

    doc = document(str(script))

    assert [(item["path"], item["state"]) for item in doc["files"]] == [
        ("launch.sh", "read"),
        ("scripts/train/yamls/pretrain/mpt-13b.yaml", "read"),
    ]
    found = reading(doc, Knob.MICRO_BATCH)
    assert (found["status"], found["value"]) == ("found", micro.value)
    written = found["occurrences"][0]["written"][0]
    assert (written["file"], written["text"]) == (
        "scripts/train/yamls/pretrain/mpt-13b.yaml",
        micro.line,
    )


def test_a_knob_mapping_reads_the_scripts_own_flag(tmp_path: Path) -> None:
    script = place(tmp_path, OWN_FLAGS)
    label = knob_label(OWN_FLAGS, Knob.MICRO_BATCH)

    unmapped = reading(document(str(script)), Knob.MICRO_BATCH)
    result = invoke(str(script), "--knob", "micro_batch=--train_batch_size")
    mapped = reading(
        document(str(script), "--knob", "micro_batch=--train_batch_size"), Knob.MICRO_BATCH
    )

    assert (unmapped["status"], unmapped["occurrences"][0]["basis"]) == ("found", "convention")
    assert (mapped["status"], mapped["value"]) == ("found", label.value)
    assert mapped["occurrences"][0]["basis"] == "user"
    assert "    wins: --train_batch_size (your --knob mapping)" in result.stdout
    assert quoted(result.stdout, "written", str(script), label.line)


@pytest.mark.parametrize("number", sorted(LABELS))
def test_every_corpus_script_reads_the_same_as_text_and_json(tmp_path: Path, number: str) -> None:
    script = place(tmp_path, number)

    text = invoke(str(script))
    doc = document(str(script))

    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[-1] == f"verdict: {doc['verdict']['text']}"
    heads = {
        "found": lambda item: f"  {item['knob']} = {item['value']}",
        "runtime": lambda item: f"  {item['knob']}: set at run time: {item['value']}",
        "invalid": lambda item: f"  {item['knob']}: not managed in this template: written as ",
        "not_found": lambda item: f"  {item['knob']}: not managed in this template: ",
    }
    for item in doc["knobs"]:
        head = heads[item["status"]](item).replace("\n", "\\n")
        assert any(line.startswith(head) for line in lines), head


# ------------------------------------------------------------------ files not there, or hostile


def test_a_missing_config_leaves_its_knobs_at_run_time(tmp_path: Path) -> None:
    script = place(tmp_path, DEEPSPEED_BESIDE, configs=False)

    doc = document(str(script))

    [config] = doc["files"]
    assert config["path"] == "ds_config.json"
    assert config["location"] == str(script.parent / "ds_config.json")
    assert (config["state"], config["refusal"]) == ("missing", "missing")
    for knob in (Knob.MICRO_BATCH, Knob.GRAD_ACCUM, Knob.GLOBAL_BATCH, Knob.ZERO_STAGE):
        item = reading(doc, knob)
        assert item["status"] == "runtime", knob
        assert "ds_config.json" in item["reason"]
    assert doc["verdict"]["text"].startswith(
        "not ready to manage: global batch, micro-batch and accumulation set at run time"
        " (--deepspeed_config ds_config.json was not given)"
    )


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _root_only_link(path: Path) -> None:
    secret = path.parent.parent / "secret.json"
    secret.write_text('{"train_batch_size": 987654}\n')
    secret.chmod(0o600)
    path.symlink_to(secret)


def _nul_bytes(path: Path) -> None:
    path.write_bytes(b'{"train_batch_size": 987654}\n\0')


def _too_large(path: Path) -> None:
    path.write_bytes(b'{"train_batch_size": 987654}' + b" " * MAX_FILE_BYTES)


def _directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    ("make", "refusal"),
    [
        (_fifo, "not_regular"),
        (_root_only_link, "symlink"),
        (_nul_bytes, "unusable"),
        (_too_large, "too_large"),
        (_directory, "not_regular"),
    ],
    ids=["fifo", "symlink-to-root-only", "nul-bytes", "too-large", "directory"],
)
def test_a_hostile_config_is_refused_and_reported(tmp_path: Path, make: Any, refusal: str) -> None:
    script = place(tmp_path, DEEPSPEED_BESIDE, configs=False)
    make(script.parent / "ds_config.json")

    result = invoke(str(script), "--json")
    text = invoke(str(script))

    assert result.exit_code == 0, result.output
    assert text.exit_code == 0, text.output
    doc = json.loads(result.stdout)
    [config] = doc["files"]
    assert (config["state"], config["refusal"]) == ("refused", refusal)
    assert f"ds_config.json ({script.parent / 'ds_config.json'}): refused ({refusal}): " in (
        text.stdout
    )
    assert reading(doc, Knob.GLOBAL_BATCH)["status"] == "runtime"
    assert "987654" not in result.stdout + text.stdout


@pytest.mark.users
def test_a_root_only_file_is_denied_to_its_owner_through_the_setpriv_reader() -> None:
    alice = alice_owner()
    with owned_dir(alice) as home:
        secret = home.parent / "ds.json"
        secret.write_bytes(b'{"train_batch_size": 987654}\n' + SECRET)
        secret.chmod(0o600)
        script = home / "job.sbatch"
        script.write_text(
            "#!/bin/bash\n#SBATCH --nodes=1\n"
            f"deepspeed train.py --deepspeed --deepspeed_config {secret}\n"
        )
        os.chown(script, alice.uid, alice.gid)
        read = caller_reader(alice)

        gathered = gather(
            read_script(read, str(script)),
            name=str(script),
            read=read,
            submit_dir=str(home),
            owner=alice,
        )

    [config] = gathered.files
    assert (config.state, config.refusal) == (FileState.REFUSED, RefusalKind.DENIED)
    rendered = json.dumps(report_document(gathered))
    assert "987654" not in rendered
    assert SECRET.decode().strip() not in rendered


def test_files_are_read_in_bounded_rounds_and_numbers() -> None:
    chain = {f"/w/s{i}.sh": f"source s{i + 1}.sh\n".encode() for i in range(MAX_ROUNDS + 2)}
    many = "".join(f"source m{i}.sh\n" for i in range(MAX_FILES + 3))
    asked: list[str] = []

    def read(location: str) -> bytes:
        asked.append(location)
        if location not in chain:
            raise OwnerReadRefused(Refusal(RefusalKind.MISSING, location, "u", "not there"))
        return chain[location]

    me = Owner.current()
    chained = gather(
        "source s0.sh\ntorchrun t.py\n", name="j", read=read, submit_dir="/w", owner=me
    )
    asked.clear()
    wide = gather(many + "torchrun t.py\n", name="j", read=read, submit_dir="/w", owner=me)

    assert chained.rounds == MAX_ROUNDS
    states = [(outcome.path, outcome.state) for outcome in chained.files]
    assert states[: MAX_ROUNDS - 1] == [(f"s{i}.sh", FileState.READ) for i in range(MAX_ROUNDS - 1)]
    assert states[MAX_ROUNDS - 1] == (f"s{MAX_ROUNDS - 1}.sh", FileState.SKIPPED)
    assert chained.files[-1].reason == f"not read: stopped after {MAX_ROUNDS} rounds"
    assert len(asked) == MAX_FILES
    skipped = [outcome for outcome in wide.files if outcome.state is FileState.SKIPPED]
    assert len(skipped) == 3
    assert skipped[0].reason == f"not read: the script names more than {MAX_FILES} files"


def test_owner_relative_paths_are_read_from_the_owners_home() -> None:
    me = Owner.current()
    home = Path(pwd.getpwuid(me.uid).pw_dir)
    read_from: list[str] = []

    def read(location: str) -> bytes:
        read_from.append(location)
        return b"batch_size: 4\n"

    gather(
        "tune run recipe --config /home/$USER/cfg.yaml\naccelerate launch --config_file"
        " ~/acc.yaml train.py\n",
        name="j",
        read=read,
        submit_dir="/w",
        owner=me,
    )

    assert sorted(read_from) == sorted([f"/home/{me.name}/cfg.yaml", str(home / "acc.yaml")])


# ------------------------------------------------------------------ what reaches the terminal


def test_control_characters_in_a_script_line_are_shown_as_escapes(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    hostile = "/ckpt/\x1b]0;owned\x07run\u202etxt\x9b2J"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --gres=gpu:2\n"
        "torchrun --nproc_per_node=2 train.py --per_device_train_batch_size 4 \\\n"
        f'  --gradient_accumulation_steps 2 --output_dir "{hostile}"\n'
    )

    text = invoke(str(script))
    as_json = invoke(str(script), "--json")

    shown = "/ckpt/\\x1b]0;owned\\x07run\\u202etxt\\x9b2J"
    assert f"Checkpoint directory\n  {shown}\n" in text.stdout
    assert quoted(
        text.stdout,
        "written",
        str(script),
        f'  --gradient_accumulation_steps 2 --output_dir "{shown}"',
    )
    for raw in ("\x1b", "\x07", "\u202e", "\x9b"):
        assert raw not in text.stdout
        assert raw not in as_json.stdout
    assert json.loads(as_json.stdout)["checkpoint"]["directory"] == hostile


def test_bytes_that_are_not_utf8_are_shown_as_hex(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_bytes(
        b"#!/bin/bash\n#SBATCH --nodes=1\n"
        b"torchrun train.py --per_device_train_batch_size 4 --output_dir /ckpt/caf\xe9\n"
    )

    text = invoke(str(script))
    doc = document(str(script))

    assert "Checkpoint directory\n  /ckpt/caf\\xe9\n" in text.stdout
    assert doc["checkpoint"]["directory"] == "/ckpt/caf\\xe9"


# ------------------------------------------------------------------ the document and exit codes


def test_the_json_document_has_the_documented_shape(tmp_path: Path) -> None:
    script = place(tmp_path, DEEPSPEED_BESIDE)

    doc = document(str(script))
    help_text = CliRunner().invoke(main, ["template", "analyse", "--help"]).stdout

    assert set(doc) == DOCUMENT
    assert all(key in help_text for key in DOCUMENT)
    assert [item["knob"] for item in doc["knobs"]] == [knob.value for knob in Knob]
    line_keys = {"file", "number", "text"}
    for item in doc["knobs"]:
        assert set(item) == {"knob", "status", "value", "reason", "occurrences"}
        for occurrence in item["occurrences"]:
            assert set(occurrence) == {
                "effect", "status", "value", "basis", "source", "presence", "reason", "written",
                "via",
            }  # fmt: skip
            assert all(set(line) == line_keys for line in occurrence["written"] + occurrence["via"])
    assert set(doc["files"][0]) == {"path", "location", "state", "refusal", "reason"}
    assert set(doc["checkpoint"]) == {
        "state", "directory", "source", "line", "script_value", "reason",
    }  # fmt: skip
    [launch] = doc["launches"]
    assert set(launch) == {"launcher", "program", "primary", "het_group", "line", "resume_flags"}
    assert set(launch["line"]) == line_keys
    insertion = {"available", "file", "after_line", "why"}
    assert set(doc["insertions"]) == {"env", "resume"}
    assert set(doc["insertions"]["env"]) == insertion
    [resume] = doc["insertions"]["resume"]
    assert set(resume) == insertion | {"launch", "launcher", "program", "existing_flags"}
    assert set(doc["verdict"]) == {"ready", "text", "missing", "terms"}
    assert set(doc["verdict"]["terms"]) == {
        "global_batch", "micro_batch", "grad_accum", "checkpoint_dir",
    }  # fmt: skip
    text = invoke(str(script)).stdout
    assert text.splitlines()[-1] == f"verdict: {doc['verdict']['text']}"


@pytest.mark.parametrize(
    "args",
    [
        ("--knob", "batch=--bs"),
        ("--knob", "micro_batch"),
        ("--knob", "micro_batch=--bs", "--knob", "eval_batch=--bs"),
        ("--checkpoint-dir", ""),  # a relative one is taken from the current directory
    ],
)
def test_a_bad_option_is_a_usage_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    script = place(tmp_path, READY_HF)

    result = invoke(str(script), *args)

    assert result.exit_code == 2, result.output
    assert result.stdout == ""


def test_an_unreadable_script_exits_3(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.sbatch"
    os.mkfifo(fifo)
    binary = tmp_path / "binary.sbatch"
    binary.write_bytes(b"#!/bin/bash\n\0\0")

    results = {
        name: invoke(str(path))
        for name, path in {
            "missing": tmp_path / "none.sbatch",
            "fifo": fifo,
            "directory": tmp_path,
            "binary": binary,
        }.items()
    }

    assert {name: result.exit_code for name, result in results.items()} == dict.fromkeys(results, 3)
    assert "missing" in results["missing"].stderr
    assert "not_regular" in results["fifo"].stderr
    assert "NUL bytes" in results["binary"].stderr
    assert all(result.stdout == "" for result in results.values())
