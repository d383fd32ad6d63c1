"""Expansion of sbatch's stdout/stderr filename patterns, as slurmd does it for the batch step.

Accounting of 22.05 does not store the patterns, so slurm-medic often has to expand a pattern
itself (from `scontrol show job` or from its own template) to find a job's log.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

_SPEC = re.compile(r"%([0-9]*)([%AaJjNnstux])")
# Linux's PATH_MAX: a longer result is no file slurmd could have opened.
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class PathContext:
    """What the batch step of a job knows when slurmd names its output files."""

    job_id: int
    name: str
    user: str
    first_node: str | None = None  # the batch host's short hostname (usually its node name)
    array_job_id: int | None = None
    array_task_id: int | None = None
    step: str = "batch"
    node_index: int = 0
    task_id: int = 0


def expand_std_path(
    pattern: str, context: PathContext, *, work_dir: str | None = None
) -> str | None:
    """Expand `%j %x %u %N %A %a %J %s %t %n %%` (with zero padding, `%3a`) in `pattern`.

    A backslash anywhere in the pattern turns replacement off, as in sbatch; relative results
    are joined to `work_dir` because that is where slurmd opens them. Unknown specifiers stay.
    `%a` of a job that is not an array task is 4294967294 (Slurm's NO_VAL), as slurmd writes.
    None where the result cannot be a path (longer than PATH_MAX, or holding a NUL): both the
    pattern and the job name are the user's, and `%x` a thousand times is not a log file.
    """
    if len(pattern) > MAX_PATH_CHARS:
        return None
    if "\\" in pattern:
        expanded = pattern.replace("\\", "")
    else:
        pieces: list[str] = []
        length = 0
        position = 0
        for match in _SPEC.finditer(pattern):
            pieces += [pattern[position : match.start()], _replace(match, context)]
            length += len(pieces[-2]) + len(pieces[-1])
            if length > MAX_PATH_CHARS:
                return None
            position = match.end()
        pieces.append(pattern[position:])
        expanded = "".join(pieces)
    if work_dir and not posixpath.isabs(expanded):
        expanded = posixpath.join(work_dir, expanded)
    if len(expanded) > MAX_PATH_CHARS or "\x00" in expanded:
        return None
    return expanded


def default_stdout_pattern(*, is_array: bool) -> str:
    """sbatch's default when no --output was given."""
    return "slurm-%A_%a.out" if is_array else "slurm-%j.out"


def _replace(match: re.Match[str], context: PathContext) -> str:
    # Three significant digits already say "more than 10": int() never sees a long run.
    width_text, spec = match.group(1).lstrip("0"), match.group(2)
    width = min(int(width_text[:3] or "0"), 10)
    if spec == "%":
        return "%"
    if spec == "x":
        return context.name
    if spec == "u":
        return context.user
    if spec == "N":
        return context.first_node or ""
    if spec == "s":
        return context.step
    if spec == "J":
        own = str(context.job_id).zfill(width)
        return own if context.step == "batch" else f"{own}.{context.step}"
    numbers = {
        "j": context.job_id,
        "A": context.array_job_id if context.array_job_id is not None else context.job_id,
        "a": context.array_task_id if context.array_task_id is not None else 4294967294,
        "n": context.node_index,
        "t": context.task_id,
    }
    return str(numbers[spec]).zfill(width)
