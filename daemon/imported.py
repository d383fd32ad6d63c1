"""Imported templates: the user's own sbatch script, verbatim, and the knobs found in it.

An imported template directory holds the script exactly as its owner wrote it and a
`template.toml` that says only what the script cannot: its name, dialect, the owner's mapping
of their program's own flags to knobs, and a checkpoint directory when the script does not
name one. Loading analyses the script again (`daemon.importer`, pure and bounded), so the
script stays the one source of truth.

Which knobs the script manages is `imported_reading`'s, rendering a change into it
`imported_render`'s; this module holds what both share (the records, the TOML's keys) and the
writing of a new template directory at import.

A knob whose value lives in a config file the script names by a path (`--deepspeed_config
ds.json`, an accelerate or training YAML) is managed through a copy of that file kept in the
template (`configs/<name>`, taken at import): the daemon never writes a user's file. A change
is written into the copy, and the rendered script writes the patched copy itself, at run time
and as the job's user (a quoted heredoc after the #SBATCH header, into `$HOME/.slurm-medic/
<hash>/`, a directory every node sees and the job's user may write whoever submits it: a
relaunch's sbatch runs from the daemon's directory, so `$SLURM_SUBMIT_DIR` is not the job's),
and names that path where it named the original. Where the path cannot be rewritten (assembled
from pieces, written inside another file or in quotes that do not expand) or the heredoc's
delimiter occurs in the text, the knob is not managed.
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.dialects.base import Dialect, KnobValue, Role
from daemon.importer import (
    Analysis,
    Effect,
    Knob,
    Line,
    Site,
    Status,
)
from daemon.owner_serve import MAX_TEMPLATE_CONFIG_BYTES, MAX_TEMPLATE_CONFIGS

IMPORTED_KEY: Final = "imported"
IMPORTED_SCRIPT: Final = "job.sbatch"
CHECKPOINT_KEY: Final = "checkpoint_dir"
KNOB_NAMES_TABLE: Final = "knob_names"
ELSEWHERE_TABLE: Final = "not_managed"
CONFIGS_TABLE: Final = "configs"  # the path the script names -> its copy in the template
CONFIGS_DIR: Final = "configs"
COPY_DELIMITER: Final = "SLURM_MEDIC_EOF"

# What each importer knob means to a dialect: the role its knob plays.
ROLE_OF: Final[Mapping[Knob, Role]] = {
    Knob.MICRO_BATCH: Role.MICRO_BATCH,
    Knob.GRAD_ACCUM: Role.GRAD_ACCUM,
    Knob.GLOBAL_BATCH: Role.GLOBAL_BATCH,
    Knob.NODES: Role.NODES,
    Knob.GPUS_PER_NODE: Role.GPUS_PER_NODE,
    Knob.ZERO_STAGE: Role.SHARDING,
    Knob.RECOMPUTE: Role.RECOMPUTE,
    Knob.EVAL_BATCH: Role.EVAL_BATCH,
    Knob.WORKERS: Role.WORKERS,
    Knob.SEQ_LEN: Role.SEQ_LENGTH,
}
CHECKPOINT_LAYOUTS: Final[Mapping[str, CheckpointLayout]] = {
    "hf": CheckpointLayout.HF,
    "megatron": CheckpointLayout.MEGATRON,
    "deepspeed": CheckpointLayout.DEEPSPEED,
    "torchrun": CheckpointLayout.DCP,
}
_COPY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_NOT_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class SpliceError(ValueError):
    """A change that cannot be written into the user's script, with the reason."""


class Writing(StrEnum):
    """How a managed knob's change reaches the script."""

    SITES = "sites"  # its value is replaced where the script writes it
    ENV = "env"  # allocator variables replaced in place, other exports added after the header
    EXCLUDE = "exclude"  # the --exclude directive's value, or one directive added
    RESUME_FLAG = "resume_flag"  # the dialect's flag appended to the training command
    RESUME_ENV = "resume_env"  # the dialect's variable exported after the header


@dataclass(frozen=True)
class Managed:
    """One managed knob: how a change is written, and where, in words for a person."""

    knob: str
    writing: Writing
    where: str
    source: Knob | None = None  # the importer knob read for it (SITES)
    sites: tuple[Site, ...] = ()  # SITES: the winning place and its mirrors
    presence: bool = False  # one of the sites is a flag whose presence means true
    flag: str = ""  # RESUME_FLAG: the flag; RESUME_ENV: the variable
    through: tuple[str, ...] = ()  # SITES: config files changed through the template's copy


@dataclass(frozen=True)
class ConfigCopy:
    """A config file the script names, as the template keeps it."""

    path: str  # as the analysis names it (the script's path, relative to the submit dir)
    copy: str  # the file in the template directory: `configs/<name>`
    text: str


@dataclass(frozen=True)
class CarriedConfig:
    """A kept config and whether a change can reach the run through it: the places the script
    writes its path (each replaced by the patched copy's), or why it cannot."""

    config: ConfigCopy
    path_sites: tuple[Site, ...]
    why_not: str  # empty when a patched copy can replace the original


@dataclass(frozen=True)
class ImportedScript:
    """An imported template's script and what is known of it: the model `render` splices."""

    text: str
    file: str  # the script's name in the template directory, as the analysis names it
    analysis: Analysis
    knob_names: Mapping[str, Knob]
    managed: Mapping[str, Managed]
    not_managed: Mapping[str, str]  # knob -> why
    values: Mapping[str, KnobValue]  # the script's values; placeholders for knobs not managed
    env_sites: Mapping[str, Site]  # allocator variable -> the place its value is written
    checkpoint_dir: str | None  # given with --checkpoint-dir
    configs: Mapping[str, CarriedConfig]  # the path the script names -> its kept copy

    def line_of(self, knob: str) -> Line | None:
        managed = self.managed.get(knob)
        return managed.sites[0].line if managed is not None and managed.sites else None


def invariant_terms(dialect: Dialect) -> tuple[str, ...]:
    """The knobs the dialect's batch invariant is computed from."""
    roles = [Role.NODES, Role.GPUS_PER_NODE, Role.MICRO_BATCH, Role.TENSOR_PARALLEL]
    roles += [Role.PIPELINE_PARALLEL]
    roles.append(Role.GLOBAL_BATCH if dialect.global_batch_fixed else Role.GRAD_ACCUM)
    return tuple(knob for role in roles if (knob := dialect.knob_for(role)) is not None)


def checkpoint_of(dialect: Dialect, imported: ImportedScript) -> CheckpointSpec | None:
    """Where the run writes checkpoints: the directory given at import, else the script's own
    when it is an absolute path written in it."""
    root = imported.checkpoint_dir
    if root is None:
        reading = imported.analysis.reading(Knob.CHECKPOINT_DIR)
        if reading.status is Status.FOUND and reading.value and reading.value.startswith("/"):
            root = reading.value
    if root is None:
        return None
    return CheckpointSpec(CHECKPOINT_LAYOUTS[dialect.name], root)


# ---------------------------------------------------------------- writing the directory


def imported_toml(
    *,
    name: str,
    dialect: str,
    knob_names: Mapping[str, Knob],
    elsewhere: Mapping[Knob, str],
    checkpoint_dir: str | None,
    configs: Sequence[ConfigCopy] = (),
) -> str:
    """The `template.toml` of an imported template (TOML basic strings are JSON strings)."""
    lines = [
        f"name = {json.dumps(name)}",
        f"dialect = {json.dumps(dialect)}",
        f"script = {json.dumps(IMPORTED_SCRIPT)}",
        f"{IMPORTED_KEY} = true",
    ]
    if checkpoint_dir is not None:
        lines.append(f"{CHECKPOINT_KEY} = {json.dumps(checkpoint_dir)}")
    lines += ["", f"[{KNOB_NAMES_TABLE}]"]
    lines += [f"{json.dumps(flag)} = {json.dumps(knob.value)}" for flag, knob in knob_names.items()]
    lines += ["", f"[{ELSEWHERE_TABLE}]"]
    lines += [f"{knob.value} = {json.dumps(why)}" for knob, why in elsewhere.items()]
    lines += ["", f"[{CONFIGS_TABLE}]"]
    lines += [f"{json.dumps(config.path)} = {json.dumps(config.copy)}" for config in configs]
    return "\n".join(lines) + "\n"


def elsewhere_of(analysis: Analysis, file: str, kept: Collection[str] = ()) -> dict[Knob, str]:
    """Knobs with a copy in another file the script names that the template does not keep
    (`kept`: config paths): changing the script's copy alone would make the two disagree, so
    they are recorded as not managed at import."""
    result: dict[Knob, str] = {}
    for reading in analysis.knobs:
        for occurrence in reading.occurrences:
            if occurrence.effect is Effect.OVERRIDDEN:
                continue
            sites = [s for s in (occurrence.site, *occurrence.pieces) if s is not None]
            other = next((s for s in sites if s.file not in (file, *kept)), None)
            if other is not None:
                result[reading.knob] = (
                    f"set by {occurrence.source}, line {other.line.number} of {other.file}: "
                    "a file that is not part of the template"
                )
                break
    return result


def config_copies(analysis: Analysis, file: str, texts: Mapping[str, str]) -> list[ConfigCopy]:
    """The config files an import keeps (read with the script: `texts`, path -> text): each one
    the script itself names, under a name of its own in the template's `configs/`, as many as
    the owner's reader will read back (the others stay files the template does not keep)."""
    copies: list[ConfigCopy] = []
    taken: set[str] = set()
    size = 0
    for use in analysis.config_uses:
        path = use.file
        named_here = any(site.file == file for site in (use.site, *use.pieces) if site)
        kept = any(copy.path == path for copy in copies)
        if kept or not named_here or path not in texts or len(copies) >= MAX_TEMPLATE_CONFIGS:
            continue
        length = len(texts[path].encode("utf-8", "surrogateescape"))
        if size + length > MAX_TEMPLATE_CONFIG_BYTES:
            continue
        size += length
        name = _NOT_NAME_CHARS.sub("_", posixpath.basename(path)).lstrip("._-")[:100] or "config"
        unique = name
        for number in itertools.count(2):
            if unique not in taken:
                break
            unique = f"{number}-{name}"
        taken.add(unique)
        copies.append(ConfigCopy(path, f"{CONFIGS_DIR}/{unique}", texts[path]))
    return copies


def copy_name_ok(copy: str) -> bool:
    """Whether `copy` is a file a template may keep a config as: `configs/<plain name>`."""
    directory, _, name = copy.partition("/")
    return directory == CONFIGS_DIR and bool(_COPY_NAME.match(name))
