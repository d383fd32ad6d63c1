"""Checkpoints in each framework's real layout, written in its order, and resumed from.

Files hold small placeholders (the safetensors file is a valid, tensor-less one), but the
names, the nesting and the file that marks a checkpoint complete are the framework's:

- HF Trainer: `checkpoint-N/` with model.safetensors first and trainer_state.json last;
  resume with a path or `latest` (the highest checkpoint-N, as get_last_checkpoint does).
- Megatron-LM: `iter_000000N/mp_rank_XX/model_optim_rng.pt`, then the tracker file
  `latest_checkpointed_iteration.txt`; `--load DIR` resumes from the tracker.
- DeepSpeed: `global_stepN/` with model and per-rank optimizer shards, then the `latest`
  tag file; resume from a load dir and a tag (default: the `latest` file).
- torchrun with torch.distributed.checkpoint: `step_N/` with a `.distcp` file per rank and
  `.metadata` last; RESUME_FROM names a step dir, or `latest` or the checkpoint root for the
  newest complete one.

A kill between files leaves a half-written checkpoint, as in real life: the last file is
missing, and resuming from it fails the way the framework fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from emulation.settings import Dialect

PLACEHOLDER = (
    b"emulated checkpoint shard: no tensors, written by deploy/devcluster/emulated-train\n"
)
HF_DIR = re.compile(r"^checkpoint-(\d+)$")
DCP_DIR = re.compile(r"^step_(\d+)$")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(Exception):
    """A resume the framework would refuse; the message is the framework's own wording."""


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path


def _safetensors_placeholder() -> bytes:
    """A valid safetensors file holding no tensors, only metadata saying what it is."""
    header = json.dumps({"__metadata__": {"format": "pt", "emulation": "true"}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def _write(path: Path, data: bytes, pause: Callable[[], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    pause()


def checkpoint_path(dialect: Dialect, root: Path, step: int) -> Path:
    if dialect is Dialect.HF:
        return root / f"checkpoint-{step}"
    if dialect is Dialect.MEGATRON:
        return root / f"iter_{step:07d}"
    if dialect is Dialect.DEEPSPEED:
        return root / f"global_step{step}"
    return root / f"step_{step}"


def write_checkpoint(
    dialect: Dialect,
    root: Path,
    *,
    step: int,
    max_steps: int,
    world_size: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    pause: Callable[[], None],
) -> Path:
    """Write step `step`'s checkpoint under `root` file by file, the completing file last."""
    path = checkpoint_path(dialect, root, step)
    if dialect is Dialect.HF:
        _write(path / "config.json", b'{"model_type": "llama", "emulation": true}\n', pause)
        _write(path / "model.safetensors", _safetensors_placeholder(), pause)
        _write(path / "optimizer.pt", PLACEHOLDER, pause)
        _write(path / "scheduler.pt", PLACEHOLDER, pause)
        for rank in range(world_size):
            _write(path / f"rng_state_{rank}.pth", PLACEHOLDER, pause)
        state = {"global_step": step, "max_steps": max_steps, "log_history": []}
        _write(path / "trainer_state.json", json.dumps(state, indent=2).encode(), pause)
    elif dialect is Dialect.MEGATRON:
        for tp in range(tensor_parallel):
            for pp in range(pipeline_parallel):
                shard = (
                    f"mp_rank_{tp:02d}" if pipeline_parallel == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
                )
                _write(path / shard / "model_optim_rng.pt", PLACEHOLDER, pause)
        _write(root / MEGATRON_TRACKER, f"{step}".encode(), pause)
    elif dialect is Dialect.DEEPSPEED:
        _write(path / "mp_rank_00_model_states.pt", PLACEHOLDER, pause)
        for rank in range(world_size):
            _write(path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", PLACEHOLDER, pause)
        _write(root / "latest", f"global_step{step}".encode(), pause)
    else:
        for rank in range(world_size):
            _write(path / f"__{rank}_0.distcp", PLACEHOLDER, pause)
        _write(path / ".metadata", PLACEHOLDER, pause)
    return path


def _highest(root: Path, pattern: re.Pattern[str]) -> Path | None:
    best: tuple[int, Path] | None = None
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    for entry in entries:
        match = pattern.match(entry.name)
        if match and entry.is_dir() and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), entry)
    return None if best is None else best[1]


def _resume_hf(target: str, output_dir: str | None) -> ResumePoint:
    if target.lower() in ("latest", "true"):
        found = _highest(Path(output_dir), HF_DIR) if output_dir else None
        if found is None:
            raise CheckpointError(
                f"ValueError: No valid checkpoint found in output directory ({output_dir})"
            )
        path = found
    else:
        path = Path(target)
    if not (path / "model.safetensors").is_file():
        raise CheckpointError(f"ValueError: Can't find a valid checkpoint at {path}")
    state_file = path / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        step = int(state["global_step"])
    except FileNotFoundError:
        raise CheckpointError(
            f"FileNotFoundError: [Errno 2] No such file or directory: '{state_file}'"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"json.decoder.JSONDecodeError: {state_file}: {error}") from None
    return ResumePoint(step, path)


def _resume_megatron(target: str) -> ResumePoint | None:
    root = Path(target)
    tracker = root / MEGATRON_TRACKER
    try:
        text = tracker.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"ERROR: Invalid metadata file {tracker}. Exiting")
    step = int(text)
    path = checkpoint_path(Dialect.MEGATRON, root, step)
    if not any(path.glob("mp_rank_*/model_optim_rng.pt")):
        raise CheckpointError(f"FileNotFoundError: no checkpoint shards under {path}")
    return ResumePoint(step, path)


def _resume_deepspeed(target: str, tag: str | None) -> ResumePoint | None:
    root = Path(target)
    if tag is None:
        try:
            tag = (root / "latest").read_text(encoding="utf-8").strip()
        except OSError:
            return None
    match = re.fullmatch(r"global_step(\d+)", tag)
    path = root / tag
    if match is None or not (path / "mp_rank_00_model_states.pt").is_file():
        raise CheckpointError(
            f"FileNotFoundError: [Errno 2] No such file or directory: "
            f"'{path / 'mp_rank_00_model_states.pt'}'"
        )
    return ResumePoint(int(match.group(1)), path)


def _resume_dcp(target: str, output_dir: str | None) -> ResumePoint:
    if target == "latest":
        complete = [
            path
            for path in (Path(output_dir).glob("step_*") if output_dir else [])
            if DCP_DIR.match(path.name) and (path / ".metadata").is_file()
        ]
        if not complete:
            raise CheckpointError(f"FileNotFoundError: no complete checkpoint in {output_dir}")
        path = max(complete, key=lambda p: int(p.name.removeprefix("step_")))
    else:
        path = Path(target)
        if DCP_DIR.match(path.name) is None and path.is_dir():
            return _resume_dcp("latest", str(path))
    match = DCP_DIR.match(path.name)
    if match is None or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"FileNotFoundError: [Errno 2] No such file or directory: '{path / '.metadata'}'"
        )
    return ResumePoint(int(match.group(1)), path)


def find_resume_point(
    dialect: Dialect, target: str, *, output_dir: str | None, tag: str | None
) -> ResumePoint | None:
    """Where the run resumes, or None where the framework starts fresh (Megatron, DeepSpeed
    with no tracker yet); raises CheckpointError where the framework would fail."""
    if dialect is Dialect.HF:
        return _resume_hf(target, output_dir)
    if dialect is Dialect.MEGATRON:
        return _resume_megatron(target)
    if dialect is Dialect.DEEPSPEED:
        return _resume_deepspeed(target, tag)
    return _resume_dcp(target, output_dir)
