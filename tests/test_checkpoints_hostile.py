"""A hostile or broken newest checkpoint is skipped with its reason, never the end of the scan
(issue 23): deep nesting, a huge file, bytes that are not JSON, wrong types, absurd numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon.checkpoints import (
    MAX_STEP,
    CheckpointLayout,
    CheckpointScan,
    CheckpointSpec,
    find_last_good,
)
from daemon.owner_files import OwnerFiles
from tests.test_owner_files import alice_owner, owned_dir

DEPTH = 100_000


def _checkpoint(root: Path, name: str, state: bytes) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "trainer_state.json").write_bytes(state)
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def _step(scan: CheckpointScan) -> int | None:
    """The found checkpoint's step (the scan must have found one)."""
    assert scan.found is not None, scan
    return scan.found.step


def _good_and_hostile(root: Path, hostile: bytes, name: str = "checkpoint-200") -> None:
    _checkpoint(root, "checkpoint-100", b'{"global_step": 100, "epoch": 0.5, "log_history": []}')
    _checkpoint(root, name, hostile)


HOSTILE = {
    "nested arrays": (b"[" * DEPTH + b"]" * DEPTH, "nests too deeply"),
    "nested objects": (b'{"a":' * DEPTH + b"1" + b"}" * DEPTH, "nests too deeply"),
    "unclosed nesting": (b"[" * DEPTH, "nests too deeply"),
    "millions of arrays": (b"[" + b"[]," * 2_000_001 + b"[]]", "objects and arrays"),
    "not JSON": (b"\x00\xff garbage {", "not valid JSON"),
    "not UTF-8": (b'{"a": "\xff\xfe"}', "not valid JSON"),
    "an array": (b"[1, 2, 3]", "not an object"),
    "a string step": (b'{"global_step": "200"}', "global_step is a string"),
    "a boolean step": (b'{"global_step": true}', "global_step is a boolean"),
    "a nested step": (b'{"global_step": ' + b"[" * 500 + b"]" * 500 + b"}", "is an array"),
    "a negative step": (b'{"global_step": -1}', "out of range"),
    "a step past 64 bits": (b'{"global_step": %d}' % 2**64, "out of range"),
    "a 5000-digit step": (b'{"global_step": ' + b"9" * 5000 + b"}", "number too long"),
    "an infinite epoch": (b'{"global_step": 200, "epoch": 1e999}', "epoch is out of range"),
    "a NaN epoch": (b'{"global_step": 200, "epoch": NaN}', "epoch is out of range"),
    "a string epoch": (b'{"global_step": 200, "epoch": "1"}', "epoch is a string"),
    "a log that is no list": (b'{"global_step": 200, "log_history": {}}', "log_history is an"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_trainer_state_falls_back_to_the_older_good_checkpoint(
    tmp_path: Path, case: str
) -> None:
    hostile, reason = HOSTILE[case]
    _good_and_hostile(tmp_path, hostile)
    scan = find_last_good(CheckpointSpec(CheckpointLayout.HF, str(tmp_path)))
    assert scan.found is not None
    assert scan.found.path == tmp_path.resolve() / "checkpoint-100"
    assert scan.found.step == 100
    [skip] = scan.skipped
    assert skip.name == "'checkpoint-200'"
    assert reason in skip.reason
    assert len(skip.reason) < 300  # the reason names the problem; it never quotes the value


def test_a_trainer_state_over_the_size_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    _good_and_hostile(tmp_path, b"")
    with open(tmp_path / "checkpoint-200" / "trainer_state.json", "r+b") as handle:
        handle.truncate(65 * 1024 * 1024)  # sparse: no disk, no read
    scan = find_last_good(CheckpointSpec(CheckpointLayout.HF, str(tmp_path)))
    assert _step(scan) == 100
    assert "larger than" in scan.skipped[0].reason


def test_a_shard_index_nested_too_deeply_is_a_skip_too(tmp_path: Path) -> None:
    _good_and_hostile(tmp_path, b'{"global_step": 200}')
    hostile = tmp_path / "checkpoint-200"
    (hostile / "model.safetensors").unlink()
    (hostile / "model.safetensors.index.json").write_bytes(b"[" * DEPTH)
    scan = find_last_good(CheckpointSpec(CheckpointLayout.HF, str(tmp_path)))
    assert _step(scan) == 100
    assert "model.safetensors.index.json nests too deeply" in scan.skipped[0].reason


def test_a_step_number_past_the_records_integers_is_skipped(tmp_path: Path) -> None:
    name = f"checkpoint-{MAX_STEP + 1}"
    _good_and_hostile(tmp_path, b"{}", name=name)
    scan = find_last_good(CheckpointSpec(CheckpointLayout.HF, str(tmp_path)))
    assert _step(scan) == 100
    assert scan.skipped[0].name == repr(name)
    assert "step number over" in scan.skipped[0].reason


@pytest.mark.parametrize("tracker", ["\N{SUPERSCRIPT TWO}", "9" * 4000, str(MAX_STEP + 1)])
def test_a_megatron_tracker_that_names_no_real_iteration_is_a_reason(
    tmp_path: Path, tracker: str
) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    (tmp_path / "iter_0000002").mkdir()
    scan = find_last_good(CheckpointSpec(CheckpointLayout.MEGATRON, str(tmp_path)))
    assert scan.found is None
    assert "not an iteration" in scan.reason


@pytest.mark.users
def test_the_owners_reading_child_falls_back_too() -> None:
    """The daemon's scan, as the owner in a child under its memory limit."""
    alice = alice_owner()
    with owned_dir(alice) as home:
        root = home / "out"
        _good_and_hostile(root, b'{"a":' * DEPTH)
        for path in [root, *root.rglob("*")]:
            os.chown(path, alice.uid, alice.gid)
        scan = OwnerFiles(alice).find_last_good(CheckpointSpec(CheckpointLayout.HF, str(root)))
    assert scan.found is not None
    assert scan.found.step == 100
    assert "nests too deeply" in scan.skipped[0].reason


def test_the_good_checkpoint_is_still_read_whole(tmp_path: Path) -> None:
    """The checks accept what the Trainer writes: a float epoch, a log, extra keys."""
    state = {"global_step": 200, "epoch": 1.25, "log_history": [{"loss": 1.5}], "trial": None}
    _good_and_hostile(tmp_path, json.dumps(state).encode())
    scan = find_last_good(CheckpointSpec(CheckpointLayout.HF, str(tmp_path)))
    assert _step(scan) == 200
