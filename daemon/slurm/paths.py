"""Expansion of sbatch's stdout/stderr filename patterns, as slurmd does it for the batch step.

Accounting of 22.05 does not store the patterns, so slurm-medic often has to expand a pattern
itself (from `scontrol show job` or from its own template) to find a job's log.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

_SPEC = re.compile(r"%(\d*)([%AaJjNnstux])")


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


def expand_std_path(pattern: str, context: PathContext, *, work_dir: str | None = None) -> str:
    """Expand `%j %x %u %N %A %a %J %s %t %n %%` (with zero padding, `%3a`) in `pattern`.

    A backslash anywhere in the pattern turns replacement off, as in sbatch; relative results
    are joined to `work_dir` because that is where slurmd opens them. Unknown specifiers stay.
    `%a` of a job that is not an array task is 4294967294 (Slurm's NO_VAL), as slurmd writes.
    """
    if "\\" in pattern:
        expanded = pattern.replace("\\", "")
    else:
        expanded = _SPEC.sub(lambda match: _replace(match, context), pattern)
    if work_dir and not posixpath.isabs(expanded):
        return posixpath.join(work_dir, expanded)
    return expanded


def default_stdout_pattern(*, is_array: bool) -> str:
    """sbatch's default when no --output was given."""
    return "slurm-%A_%a.out" if is_array else "slurm-%j.out"


def _replace(match: re.Match[str], context: PathContext) -> str:
    width_text, spec = match.group(1), match.group(2)
    width = min(int(width_text), 10) if width_text else 0
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
