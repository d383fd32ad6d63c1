"""Finding the last good checkpoint in real directory trees, half-written and hostile ones too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon.checkpoints import (
    CheckpointError,
    CheckpointLayout,
    CheckpointSpec,
    LocalReader,
    find_last_good,
)


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def hf_checkpoint(root: Path, step: int, *, weights: str = "model.safetensors") -> Path:
    directory = root / f"checkpoint-{step}"
    write(directory / "trainer_state.json", json.dumps({"global_step": step}))
    write(directory / weights, "weights")
    return directory


def spec(layout: CheckpointLayout, root: Path, **extra: str) -> CheckpointSpec:
    return CheckpointSpec(layout=layout, root=str(root), **extra)


def skipped(scan_result: object) -> dict[str, str]:
    return {item.name: item.reason for item in scan_result.skipped}  # type: ignore[attr-defined]


def test_hf_picks_the_newest_complete_checkpoint_and_says_why_others_were_skipped(
    tmp_path: Path,
) -> None:
    hf_checkpoint(tmp_path, 100)
    hf_checkpoint(tmp_path, 150, weights="pytorch_model.bin")
    write(tmp_path / "checkpoint-200" / "model.safetensors")  # died before trainer_state.json
    write(tmp_path / "checkpoint-300" / "trainer_state.json", '{"global_step": 3')  # cut off
    write(tmp_path / "checkpoint-300" / "model.safetensors")
    write(tmp_path / "checkpoint-400" / "trainer_state.json", "{}")  # no weights yet
    (tmp_path / "runs").mkdir()
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path))
    assert result.found is not None
    assert result.found.step == 150
    assert result.found.path == tmp_path.resolve() / "checkpoint-150"
    assert result.found.resume_path == str(tmp_path.resolve() / "checkpoint-150")
    reasons = skipped(result)
    assert reasons["'checkpoint-400'"].startswith("no weights")
    assert reasons["'checkpoint-300'"].startswith("trainer_state.json is not valid JSON")
    assert reasons["'checkpoint-200'"] == "'trainer_state.json' is missing or a dangling symlink"
    assert "'checkpoint-100'" not in reasons


def test_hf_sharded_weights_need_every_shard(tmp_path: Path) -> None:
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    for step in (10, 20):
        directory = tmp_path / f"checkpoint-{step}"
        write(directory / "trainer_state.json", "{}")
        write(directory / "model.safetensors.index.json", json.dumps(index))
        write(directory / "model-00001-of-00002.safetensors")
    write(tmp_path / "checkpoint-10" / "model-00002-of-00002.safetensors")
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path))
    assert result.found is not None
    assert result.found.step == 10
    assert skipped(result)["'checkpoint-20'"] == (
        "shards missing from model.safetensors.index.json: model-00002-of-00002.safetensors"
    )


@pytest.mark.parametrize(
    "weights",
    ["model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin"],
)
def test_hf_accepts_each_single_weight_file_the_trainer_resumes_from(
    tmp_path: Path, weights: str
) -> None:
    hf_checkpoint(tmp_path, 10, weights=weights)
    write(tmp_path / "checkpoint-20" / "trainer_state.json", "{}")
    write(tmp_path / "checkpoint-20" / "adapter_config.json", "{}")  # a config is no weights
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path))
    assert result.found is not None
    assert result.found.step == 10
    assert skipped(result)["'checkpoint-20'"].startswith("no weights")


def test_hostile_trees_symlinks_out_loops_and_newlines(tmp_path: Path) -> None:
    root = tmp_path / "out"
    outside = tmp_path / "elsewhere"
    hf_checkpoint(root, 5)
    hf_checkpoint(outside, 900)
    (root / "checkpoint-900").symlink_to(outside / "checkpoint-900")
    (root / "checkpoint-800").symlink_to(root / "checkpoint-800")
    (root / "checkpoint-700").mkdir()
    (root / "checkpoint-700" / "trainer_state.json").symlink_to("/etc/hostname")
    write(root / "checkpoint-700" / "model.safetensors")
    hf_checkpoint(root, 600)
    os.rename(root / "checkpoint-600", root / "checkpoint-600\n")
    (root / "checkpoint-650").symlink_to(root / "missing")
    result = find_last_good(spec(CheckpointLayout.HF, root))
    assert result.found is not None
    assert result.found.step == 5
    reasons = skipped(result)
    assert "symlink leaving the checkpoint root" in reasons["'checkpoint-900'"]
    assert "symlink loop" in reasons["'checkpoint-800'"]
    assert "leaving the checkpoint root" in reasons["'checkpoint-700'"]
    assert "dangling symlink" in reasons["'checkpoint-650'"]
    assert all("600" not in name for name in reasons)  # a name with a newline is not a checkpoint


def test_symlink_inside_the_root_is_followed(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path / "real", 42)
    (tmp_path / "checkpoint-42").symlink_to(tmp_path / "real" / "checkpoint-42")
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path))
    assert result.found is not None
    assert result.found.path == (tmp_path / "real" / "checkpoint-42").resolve()


def test_megatron_trusts_its_tracker_and_skips_newer_half_saved_iterations(tmp_path: Path) -> None:
    write(tmp_path / "latest_checkpointed_iteration.txt", "2000\n")
    write(tmp_path / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt")
    write(tmp_path / "iter_0002000" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "iter_0003000").mkdir()
    result = find_last_good(spec(CheckpointLayout.MEGATRON, tmp_path))
    assert result.found is not None
    assert result.found.step == 2000
    assert result.found.resume_path == str(tmp_path.resolve())
    assert skipped(result) == {
        "'iter_0003000'": "newer than the tracker's 2000: save did not finish"
    }


@pytest.mark.parametrize(
    ("tracker", "reason"),
    [
        ("3000", "the tracker names iteration 3000 but iter_0003000 is missing"),
        ("oops", "latest_checkpointed_iteration.txt holds 'oops', not an iteration"),
        (None, "'latest_checkpointed_iteration.txt' is missing or a dangling symlink"),
    ],
)
def test_megatron_without_a_usable_tracker_finds_nothing(
    tmp_path: Path, tracker: str | None, reason: str
) -> None:
    if tracker is not None:
        write(tmp_path / "latest_checkpointed_iteration.txt", tracker)
    write(tmp_path / "iter_0001000" / "model.pt")
    result = find_last_good(spec(CheckpointLayout.MEGATRON, tmp_path))
    assert result.found is None
    assert result.reason == reason


def test_megatron_empty_iteration_is_half_written(tmp_path: Path) -> None:
    write(tmp_path / "latest_checkpointed_iteration.txt", "10")
    (tmp_path / "iter_0000010").mkdir()
    result = find_last_good(spec(CheckpointLayout.MEGATRON, tmp_path))
    assert result.found is None
    assert skipped(result) == {"'iter_0000010'": "iteration directory is empty"}


def test_deepspeed_follows_latest_and_refuses_a_tag_that_escapes(tmp_path: Path) -> None:
    write(tmp_path / "latest", "global_step20")
    for step in (10, 20):
        write(tmp_path / f"global_step{step}" / "mp_rank_00_model_states.pt")
    (tmp_path / "global_step30").mkdir()
    result = find_last_good(spec(CheckpointLayout.DEEPSPEED, tmp_path))
    assert result.found is not None
    assert (result.found.step, result.found.tag) == (20, "global_step20")
    assert result.found.resume_path == str(tmp_path.resolve())
    assert "save did not finish" in skipped(result)["'global_step30'"]
    write(tmp_path / "latest", "../../etc")
    result = find_last_good(spec(CheckpointLayout.DEEPSPEED, tmp_path))
    assert result.found is None
    assert "not a tag" in result.reason


def test_dcp_needs_its_metadata_file(tmp_path: Path) -> None:
    write(tmp_path / "step-100" / ".metadata", "meta")
    write(tmp_path / "step-100" / "__0_0.distcp")
    write(tmp_path / "step-200" / "__0_0.distcp")
    write(tmp_path / "notes.txt")
    result = find_last_good(spec(CheckpointLayout.DCP, tmp_path))
    assert result.found is not None
    assert result.found.step == 100
    assert skipped(result) == {"'step-200'": "no .metadata marker: the save did not finish"}


def test_dcp_with_only_per_rank_metadata_is_not_called_complete(tmp_path: Path) -> None:
    for rank in range(2):
        write(tmp_path / "step-20" / f"__{rank}.metadata")
        write(tmp_path / "step-20" / f"__{rank}_0.distcp")
    write(tmp_path / "step-10" / ".metadata")
    write(tmp_path / "step-10" / "__0_0.distcp")
    result = find_last_good(spec(CheckpointLayout.DCP, tmp_path))
    assert result.found is not None
    assert result.found.step == 10
    assert skipped(result)["'step-20'"].startswith(
        "only per-rank __R.metadata files (saved with use_collectives=False)"
    )


def test_dcp_names_with_newlines_or_lookalike_digits_are_not_checkpoints(tmp_path: Path) -> None:
    write(tmp_path / "step-3" / ".metadata")
    write(tmp_path / "step-9\n" / ".metadata")
    write(tmp_path / "step-\uff19\uff19" / ".metadata")  # fullwidth "99"
    result = find_last_good(spec(CheckpointLayout.DCP, tmp_path))
    assert result.found is not None
    assert result.found.step == 3
    assert result.skipped == ()


def test_glob_with_a_completion_marker(tmp_path: Path) -> None:
    write(tmp_path / "ckpt_0005" / "COMPLETE")
    write(tmp_path / "ckpt_0009" / "weights.bin")
    write(tmp_path / "other_0010" / "COMPLETE")
    result = find_last_good(spec(CheckpointLayout.GLOB, tmp_path, glob="ckpt_*", marker="COMPLETE"))
    assert result.found is not None
    assert result.found.step == 5
    assert set(skipped(result)) == {"'ckpt_0009'"}
    bad = find_last_good(spec(CheckpointLayout.GLOB, tmp_path, glob="*/x", marker="COMPLETE"))
    assert bad.found is None
    assert "one-level" in bad.reason


def test_an_unusable_root_is_an_error_a_missing_one_is_no_checkpoint(tmp_path: Path) -> None:
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path / "missing"))
    assert result.found is None
    assert result.reason == "the checkpoint root does not exist yet"
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CheckpointError, match="cannot be used"):
        find_last_good(spec(CheckpointLayout.HF, tmp_path / "loop"))
    write(tmp_path / "file")
    with pytest.raises(CheckpointError, match="not a directory"):
        find_last_good(spec(CheckpointLayout.HF, tmp_path / "file"))


def test_no_checkpoint_yet_is_a_reason_not_an_error(tmp_path: Path) -> None:
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path))
    assert result.found is None
    assert result.reason == "no complete checkpoint under the root"


class DenyingReader(LocalReader):
    """Reads as an owner who may not open one file (the kernel's EACCES, raised at the seam)."""

    def __init__(self, denied: Path) -> None:
        self.denied = denied
        self.reads: list[Path] = []

    def read_bytes(self, path: Path, limit: int) -> bytes:
        self.reads.append(path)
        if path == self.denied:
            raise PermissionError(13, "Permission denied")
        return super().read_bytes(path, limit)


def test_every_read_goes_through_the_reader_seam(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path, 1)
    hf_checkpoint(tmp_path, 2)
    reader = DenyingReader((tmp_path / "checkpoint-2" / "trainer_state.json").resolve())
    result = find_last_good(spec(CheckpointLayout.HF, tmp_path), reader)
    assert result.found is not None
    assert result.found.step == 1
    assert skipped(result) == {
        "'checkpoint-2'": "cannot read trainer_state.json: Permission denied"
    }
    assert reader.reads == [
        (tmp_path / "checkpoint-2" / "trainer_state.json").resolve(),
        (tmp_path / "checkpoint-1" / "trainer_state.json").resolve(),
    ]
