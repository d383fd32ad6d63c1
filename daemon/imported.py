"""Imported templates: the user's own sbatch script, verbatim, and the knobs found in it.

An imported template directory holds the script exactly as its owner wrote it and a
`template.toml` that says only what the script cannot: its name, dialect, the owner's mapping
of their program's own flags to knobs, and a checkpoint directory when the script does not
name one. Loading analyses the script again (`daemon.importer`, pure and bounded), so the
script stays the one source of truth.

A dialect knob is *managed* only where the analysis found its value written in the script
itself, every copy that the run reads agreeing; anything else (set at run time, assembled
from pieces, living in another file, invalid, not written at all) is *not managed*, with the
reason, and is never rendered nor offered as a value. Three knobs the daemon needs are added
where the script lacks them, at the places the analysis found safe: exports after the #SBATCH
header, one `#SBATCH --exclude` line, and the dialect's resume flag at the end of the training
command's arguments.

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

Rendering splices: each changed knob's new value is written over its sites (formatted for the
way the text there is read), the insertions are added, and the result is analysed again to
check that the new values read back and nothing else moved. With no change, the script comes
back byte for byte (a config's original file stays in use).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
import re
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.dialects.base import Dialect, KnobError, KnobKind, Knobs, KnobValue, Role
from daemon.importer import (
    Analysis,
    Effect,
    Form,
    ImporterError,
    Insertion,
    Knob,
    Launch,
    Line,
    Site,
    Status,
    analyse,
)
from daemon.importer.records import CONFIG_FORMS, ConfigUse
from daemon.importer.vocabulary import ALLOC_CONF_VARIABLES, RESUME_NAMES, normalise
from daemon.owner_files import MAX_TEMPLATE_CONFIG_BYTES, MAX_TEMPLATE_CONFIGS
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import expand_hostlist

IMPORTED_KEY: Final = "imported"
IMPORTED_SCRIPT: Final = "job.sbatch"
CHECKPOINT_KEY: Final = "checkpoint_dir"
KNOB_NAMES_TABLE: Final = "knob_names"
ELSEWHERE_TABLE: Final = "not_managed"
CONFIGS_TABLE: Final = "configs"  # the path the script names -> its copy in the template
CONFIGS_DIR: Final = "configs"
COPY_DELIMITER: Final = "SLURM_MEDIC_EOF"
# Where a patched copy is written at run time: the job's user's home, which every node of a
# cluster sees; the hash of the copies names the directory, so a revision's copy is its own.
COPY_ROOT: Final = "$HOME/.slurm-medic"

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
# Written as it is wherever a shell reads it, quoted or not: no blank, quote or expansion.
_SAFE_WORD = re.compile(r"[A-Za-z0-9_./:=@%+,-]+\Z")
_DIRECTIVE_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\[\]-]{1,1024}\Z")
_YAML_PLAIN = re.compile(r"[A-Za-z_./][A-Za-z0-9_./:@%+,-]*\Z")
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "~", "y", "n"})
_BOOL_STYLES = (("True", "False"), ("TRUE", "FALSE"), ("1", "0"), ("yes", "no"), ("on", "off"))
_NO_COUNTERPART = "slurm-medic does not read it in an imported script"
_COPY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_NOT_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
# Where the path to a copy can be written: `$HOME` must expand there, once, in this shell.
_PATH_FORMS = frozenset({Form.SHELL_WORD, Form.DOUBLE_QUOTED})


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


def read_imported(
    dialect: Dialect,
    text: str,
    *,
    file: str,
    knob_names: Mapping[str, Knob],
    elsewhere: Mapping[Knob, str],
    checkpoint_dir: str | None,
    configs: Sequence[ConfigCopy] = (),
) -> ImportedScript:
    """Analyse the script (with the config copies the template keeps, under the paths the
    script names) and decide, knob by knob, what is managed and how."""
    files = {config.path: config.text for config in configs}
    try:
        analysis = analyse(text, name=file, files=files, knob_names=knob_names)
    except ImporterError as error:
        raise SpliceError(f"the script cannot be analysed: {error}") from error
    carried = {config.path: _carried(config, analysis, text=text, file=file) for config in configs}
    managed: dict[str, Managed] = {}
    not_managed: dict[str, str] = {}
    values: dict[str, KnobValue] = {}
    counterpart = {dialect.roles.get(role): knob for knob, role in ROLE_OF.items()}
    for spec in dialect.knobs:
        source = counterpart.get(spec.name)
        if source is not None:
            outcome = _site_knob(
                dialect,
                analysis=analysis,
                knob=spec.name,
                source=source,
                file=file,
                elsewhere=elsewhere,
                carried=carried,
            )
            if isinstance(outcome, str):
                not_managed[spec.name] = outcome
            else:
                managed[spec.name], values[spec.name] = outcome
        elif spec.name not in _insertion_knobs(dialect):
            not_managed[spec.name] = _NO_COUNTERPART
    _unshare(analysis, managed, not_managed, values)
    found = (managed, not_managed, values)
    env_sites = _env(dialect, analysis, file=file, elsewhere=elsewhere, found=found)
    _exclude(dialect, analysis, found)
    _resume(dialect, analysis, file=file, found=found)
    for spec in dialect.knobs:
        if spec.name not in values:
            values[spec.name] = (
                spec.unset if spec.unset is not None else dialect.defaults[spec.name]
            )
    return ImportedScript(
        text=text,
        file=file,
        analysis=analysis,
        knob_names=dict(knob_names),
        managed=managed,
        not_managed=not_managed,
        values=values,
        env_sites=env_sites,
        checkpoint_dir=checkpoint_dir,
        configs=carried,
    )


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


# What is being decided about the knobs: managed ones, the others with why, and values.
_Found = tuple[dict[str, Managed], dict[str, str], dict[str, KnobValue]]


def _insertion_knobs(dialect: Dialect) -> frozenset[str]:
    roles = (Role.ENV, Role.EXCLUDE, Role.RESUME, Role.RESUME_TAG)
    return frozenset(knob for role in roles if (knob := dialect.knob_for(role)) is not None)


# ---------------------------------------------------------------- what is managed


def _site_knob(
    dialect: Dialect,
    *,
    analysis: Analysis,
    knob: str,
    source: Knob,
    file: str,
    elsewhere: Mapping[Knob, str],
    carried: Mapping[str, CarriedConfig],
) -> tuple[Managed, KnobValue] | str:
    """The knob managed at the places the analysis found it, or why it is not managed."""
    if source in elsewhere:
        return elsewhere[source]
    reading = analysis.reading(source)
    if reading.status is Status.NOT_FOUND:
        return f"{reading.reason}: slurm-medic will not invent a value"
    if reading.status is Status.RUNTIME:
        return reading.reason
    if reading.status is Status.INVALID:
        return f"written as {reading.value!r}, which it cannot take ({reading.reason})"
    sites: list[Site] = []
    through: list[str] = []
    presence = False
    for occurrence in reading.occurrences:
        if occurrence.effect is Effect.OVERRIDDEN:
            continue
        where = occurrence.source
        if occurrence.status is Status.RUNTIME:
            return f"its copy in {where} is set at run time ({occurrence.reason})"
        if occurrence.status is not Status.FOUND:
            return f"its copy in {where} is {occurrence.value!r} ({occurrence.reason})"
        if occurrence.value != reading.value:
            return f"{where} gives {occurrence.value} but the run reads {reading.value}"
        if occurrence.site is None:
            return f"the value from {where} is assembled from pieces, not written in one place"
        if occurrence.site.file != file:
            config = carried.get(occurrence.site.file)
            if config is None:
                return f"the value from {where} lives in {occurrence.site.file}, not in the script"
            if config.why_not:
                return f"the value from {where} lives in {config.config.path}: {config.why_not}"
            through.append(config.config.path)
        presence = presence or occurrence.presence
        sites.append(occurrence.site)
    value = _typed(dialect, knob, reading.value or "")
    if isinstance(value, str) and value.startswith("\0"):
        return value[1:]
    where = ", ".join(f"{site.file}:{site.line.number}" for site in dict.fromkeys(sites))
    copies = tuple(dict.fromkeys(through))
    if copies:
        kept = ", ".join(carried[path].config.copy for path in copies)
        where += f" (through the template's copy, {kept}, which the script writes when changed)"
    managed = Managed(
        knob,
        Writing.SITES,
        f"written at {where}",
        source=source,
        sites=tuple(dict.fromkeys(sites)),
        presence=presence,
        through=copies,
    )
    return managed, value


def _carried(config: ConfigCopy, analysis: Analysis, *, text: str, file: str) -> CarriedConfig:
    """Whether a patched copy of `config` can stand for it: every place the script names it
    rewritten to the copy's path, the copy written by a quoted heredoc."""
    uses = [use for use in analysis.config_uses if use.file == config.path]
    sites: list[Site] = []
    why = "" if uses else "the script does not name it where a command reads it"
    for use in uses:
        why = why or _path_problem(use, file)
        if use.site is not None:
            sites.append(use.site)
    if not why and COPY_DELIMITER in config.text:
        why = f"its text holds {COPY_DELIMITER}, which would end the heredoc that writes the copy"
    if not why and "\r\n" in text:
        why = "the script's lines end in CRLF: bash would not find the end of the copy's heredoc"
    return CarriedConfig(config, tuple(dict.fromkeys(sites)), why)


def _path_problem(use: ConfigUse, file: str) -> str:
    """Why the place that names a config cannot name its copy instead; empty when it can."""
    site = use.site
    if site is None:
        return f"its path ({use.source}) is assembled from pieces, not written in one place"
    if site.file != file:
        return f"its path ({use.source}) is written in {site.file}, not in the script"
    if site.form not in _PATH_FORMS:
        return (
            f"its path ({use.source}) is written as {site.form.value} text, where the copy's "
            "path cannot be written safely"
        )
    return ""


def _unshare(
    analysis: Analysis,
    managed: dict[str, Managed],
    not_managed: dict[str, str],
    values: dict[str, KnobValue],
) -> None:
    """A knob written at a place another knob also reads (`--bs $BS --eval_bs $BS`) is not
    managed: a change of one would silently move the other."""
    for name, knob in list(managed.items()):
        for reading in analysis.knobs:
            if reading.knob is knob.source:
                continue
            places = [
                place
                for occurrence in reading.occurrences
                for place in (occurrence.site, *occurrence.pieces)
                if place is not None
            ]
            if any(_overlap(site, place) for site in knob.sites for place in places):
                del managed[name], values[name]
                not_managed[name] = (
                    f"written at the same place as {reading.knob.value}: a change would move both"
                )
                break


def _overlap(first: Site, second: Site) -> bool:
    return first.file == second.file and first.start < second.end and second.start < first.end


def _typed(dialect: Dialect, knob: str, text: str) -> KnobValue:
    """The analysis's value as the knob's type; a reason (marked by a NUL) when it does not fit."""
    spec = dialect.spec(knob)
    value: object = text
    if spec.kind is KnobKind.INT:
        value = int(text) if text.isdigit() else text
    elif spec.kind is KnobKind.BOOL:
        value = {"true": True, "false": False}.get(text, text)
    try:
        return spec.validate(value)
    except KnobError as error:
        return f"\0written as {text!r}, which {knob} cannot take ({error})"


def _env(
    dialect: Dialect,
    analysis: Analysis,
    *,
    file: str,
    elsewhere: Mapping[Knob, str],
    found: _Found,
) -> dict[str, Site]:
    """The allocator variables the script exports, each at its place; others are added."""
    managed, not_managed, values = found
    knob = dialect.knob_for(Role.ENV)
    if knob is None:
        return {}
    insertion = analysis.env_insertion
    reading = analysis.reading(Knob.ALLOC_CONF)
    sites: dict[str, Site] = {}
    pairs: dict[str, str] = {}
    why = elsewhere.get(Knob.ALLOC_CONF, "")
    for occurrence in reading.occurrences:
        if why:
            break
        variable = occurrence.source
        if variable not in ALLOC_CONF_VARIABLES:
            why = f"the allocator setting comes from {variable}"
        elif occurrence.status is not Status.FOUND:
            why = f"{variable} is {reading.reason}"
        elif occurrence.site is None or occurrence.site.file != file:
            why = f"{variable} is not written in one place of the script"
        else:
            sites[variable] = occurrence.site
            pairs[variable] = occurrence.value
    if not why and insertion.offset is None:
        why = f"no place to add an export: {insertion.why}"
    if why:
        not_managed[knob] = why
        return {}
    where = "allocator variables replaced where the script sets them; other exports added "
    managed[knob] = Managed(knob, Writing.ENV, where + _after(insertion))
    values[knob] = tuple(sorted(pairs.items()))
    return sites


def _exclude(dialect: Dialect, analysis: Analysis, found: _Found) -> None:
    managed, not_managed, values = found
    knob = dialect.knob_for(Role.EXCLUDE)
    if knob is None:
        return
    directives = [d for d in analysis.directives if d.option == "exclude" and d.group == 0]
    if len(directives) > 1:
        not_managed[knob] = "the script has several --exclude directives"
        return
    if directives:
        directive = directives[0]
        if directive.site is None:
            not_managed[knob] = "the --exclude directive has no value"
            return
        try:
            nodes = dialect.spec(knob).validate(list(expand_hostlist(directive.value)))
        except (SlurmParseError, KnobError) as error:
            not_managed[knob] = f"--exclude={directive.value} is not a node list: {error}"
            return
        where = f"the --exclude directive at {directive.site.file}:{directive.site.line.number}"
        managed[knob] = Managed(knob, Writing.EXCLUDE, where, sites=(directive.site,))
        values[knob] = nodes
        return
    insertion = analysis.env_insertion
    if insertion.offset is None:
        not_managed[knob] = f"no place to add an #SBATCH --exclude line: {insertion.why}"
        return
    managed[knob] = Managed(knob, Writing.EXCLUDE, "an #SBATCH --exclude line " + _after(insertion))
    values[knob] = ()


def _resume(dialect: Dialect, analysis: Analysis, *, file: str, found: _Found) -> None:
    """The dialect's resume flag (and tag) at the end of the training command's arguments, or
    its resume variable exported after the header."""
    managed, not_managed, values = found
    for role in (Role.RESUME, Role.RESUME_TAG):
        knob = dialect.knob_for(role)
        if knob is None:
            continue
        flag = next((f for f, k in dialect.recognise_flags.items() if k == knob), None)
        variable = next((v for v, k in dialect.recognise_env.items() if k == knob), None)
        values[knob] = ""
        if flag is not None:
            place = _resume_place(analysis, file)
            if isinstance(place, str):
                not_managed[knob] = place
                continue
            where = f"{flag} appended to the arguments of {place.program} " + _after(place.args_end)
            if flag in place.resume_flags:
                where += f" (after the {flag} already there: the last one given wins)"
            managed[knob] = Managed(knob, Writing.RESUME_FLAG, where, flag=flag)
        elif variable is not None:
            insertion = analysis.env_insertion
            if insertion.offset is None:
                not_managed[knob] = f"no place to add an export: {insertion.why}"
                continue
            where = f"export {variable} " + _after(insertion)
            managed[knob] = Managed(knob, Writing.RESUME_ENV, where, flag=variable)
        else:
            not_managed[knob] = _NO_COUNTERPART


def _resume_place(analysis: Analysis, file: str) -> Launch | str:
    primary = [launch for launch in analysis.launches if launch.primary]
    if not primary:
        return "no command that starts training was found"
    if len(primary) > 1:
        return "several commands start training: which one resumes is not clear"
    launch = primary[0]
    if launch.launcher == "wrapper":
        return f"training starts in {launch.program}, which is not part of the template"
    if launch.args_end.offset is None:
        return f"no place to add a flag: {launch.args_end.why}"
    if launch.args_end.file != file:
        return f"the training command's arguments end in {launch.args_end.file}"
    return launch


def _after(insertion: Insertion) -> str:
    if insertion.line is None:
        return f"({insertion.why})"
    return f"{insertion.why} ({insertion.line.file}:{insertion.line.number})"


# ---------------------------------------------------------------- rendering


def splice(dialect: Dialect, imported: ImportedScript, knobs: Knobs) -> str:
    """The script with these knobs: the original text where nothing changed."""
    changed = {
        name: value for name, value in knobs.items() if value != imported.values.get(name, value)
    }
    for name in changed:
        if name in imported.not_managed:
            raise SpliceError(
                f"{name} is not managed in this template: {imported.not_managed[name]}"
            )
    if not changed:
        return imported.text
    edits: list[tuple[int, int, str]] = []
    config_edits: dict[str, list[tuple[int, int, str]]] = {}  # config path -> its copy's edits
    header: list[str] = []  # lines added after the #SBATCH header, in this order
    arguments: list[str] = []  # words added at the end of the training command
    for name in (spec.name for spec in dialect.knobs):
        if name not in changed:
            continue
        managed = imported.managed[name]
        value = changed[name]
        if managed.writing is Writing.SITES:
            for site in managed.sites:
                edit = (site.start, site.end, write_value(value, site, managed.presence))
                if site.file == imported.file:
                    edits.append(edit)
                else:
                    config_edits.setdefault(site.file, []).append(edit)
        elif managed.writing is Writing.ENV:
            edits += _env_edits(imported, imported.values[name], value, header)
        elif managed.writing is Writing.EXCLUDE:
            nodes = ",".join(str(node) for node in value) if isinstance(value, tuple) else ""
            if managed.sites:
                edits.append((managed.sites[0].start, managed.sites[0].end, _directive(nodes)))
            elif nodes:
                header.insert(0, f"#SBATCH --exclude={_directive(nodes)}")
        elif managed.writing is Writing.RESUME_ENV:
            header.append(f"export {managed.flag}={shlex.quote(str(value))}")
        elif str(value):
            arguments += [managed.flag, str(value)]
    text = imported.text
    newline = "\r\n" if "\r\n" in text else "\n"
    if config_edits:
        copies, path_edits = _config_copies(imported, config_edits)
        header += copies
        edits += path_edits
    if header:
        insertion = imported.analysis.env_insertion
        assert insertion.offset is not None  # managed only where there is a place
        lead = newline if insertion.newline_before else ""
        block = lead + newline.join(header) + ("" if insertion.newline_before else newline)
        edits.append((insertion.offset, insertion.offset, block))
    if arguments:
        edits.append(_arguments_edit(imported, arguments))
    script = _apply(text, edits)
    problems = check_rendered(dialect, imported, knobs, script)
    if problems:
        raise SpliceError("the change does not read back as written: " + "; ".join(problems))
    return script


def _config_copies(
    imported: ImportedScript, config_edits: Mapping[str, list[tuple[int, int, str]]]
) -> tuple[list[str], list[tuple[int, int, str]]]:
    """The lines that write each patched config's copy at run time, and the edits that make the
    script name the copy where it named the original."""
    patched = {
        path: _apply(imported.configs[path].config.text, edits)
        for path, edits in sorted(config_edits.items())
    }
    digest = hashlib.sha256(json.dumps(sorted(patched.items())).encode()).hexdigest()[:16]
    directory = f"{COPY_ROOT}/{digest}"
    lines = [
        "# slurm-medic: patched copies of config files this script names (the originals are "
        "not changed)",
        f'mkdir -p "{directory}" || exit 1',
    ]
    edits: list[tuple[int, int, str]] = []
    for path, text in patched.items():
        carried = imported.configs[path]
        if COPY_DELIMITER in text:
            raise SpliceError(
                f"not managed: the patched {path} holds {COPY_DELIMITER}, which would end the "
                "heredoc that writes it"
            )
        target = f"{directory}/{posixpath.basename(carried.config.copy)}"
        body = text if text.endswith("\n") else text + "\n"
        lines.append(f"cat > \"{target}\" <<'{COPY_DELIMITER}' || exit 1\n{body}{COPY_DELIMITER}")
        for site in carried.path_sites:
            written = f'"{target}"' if site.form is Form.SHELL_WORD else target
            edits.append((site.start, site.end, written))
    return lines, edits


def _env_edits(
    imported: ImportedScript, old: KnobValue, new: KnobValue, header: list[str]
) -> list[tuple[int, int, str]]:
    before, after = dict(_pairs(old)), dict(_pairs(new))
    removed = sorted(set(before) - set(after))
    if removed:
        raise SpliceError(f"removing {', '.join(removed)} from the script is not supported")
    edits = []
    for variable, text in sorted(after.items()):
        if before.get(variable) == text:
            continue
        site = imported.env_sites.get(variable)
        if site is not None:
            edits.append((site.start, site.end, write_value(text, site, False)))
        else:
            header.append(f"export {variable}={shlex.quote(text)}")
    return edits


def _pairs(value: KnobValue) -> list[tuple[str, str]]:
    if not isinstance(value, tuple):
        return []
    return [(str(pair[0]), str(pair[1])) for pair in value if isinstance(pair, tuple)]


def _arguments_edit(imported: ImportedScript, words: list[str]) -> tuple[int, int, str]:
    launch = _resume_place(imported.analysis, imported.file)
    if isinstance(launch, str):
        raise SpliceError(launch)
    insertion = launch.args_end
    assert insertion.offset is not None  # checked by _resume_place
    if insertion.form is Form.SHELL_WORD:
        written = [shlex.quote(word) for word in words]
    else:
        unsafe = [word for word in words if not _SAFE_WORD.match(word)]
        if unsafe:
            raise SpliceError(
                f"{unsafe[0]!r} cannot be added inside the script's {insertion.form} command "
                "string safely: only words without blanks, quotes or `$` can"
            )
        written = words
    return insertion.offset, insertion.offset, " " + " ".join(written)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    ordered = sorted(edits, key=lambda edit: (edit[0], edit[1]))
    for first, second in itertools.pairwise(ordered):
        if second[0] < first[1]:
            raise SpliceError("two changes would be written over the same text")
    for start, end, replacement in reversed(ordered):
        text = text[:start] + replacement + text[end:]
    return text


def write_value(value: KnobValue, site: Site, presence: bool = False) -> str:
    """`value` as it must be written at `site` to be read back as itself."""
    if presence and site.text.startswith("-"):
        if value is True:
            return site.text
        raise SpliceError(
            f"{site.text} is turned on by its presence: slurm-medic does not remove flags"
        )
    if isinstance(value, tuple):
        raise SpliceError("a list cannot be written at one place")
    if site.form in CONFIG_FORMS:
        written = _config_scalar(site.form, value, site.text)
        if site.within is Form.HEREDOC:
            written = _escape(written, "\\$`")
        return written
    text = _bool_text(value, site.text) if isinstance(value, bool) else str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise SpliceError("a value with a line break cannot be written into the script")
    if site.form is Form.DIRECTIVE:
        return _directive(text)
    if _SAFE_WORD.match(text):
        return text
    if site.form is Form.SHELL_WORD:
        return shlex.quote(text)
    if site.form is Form.DOUBLE_QUOTED:
        return _escape(text, '\\$`"')
    if site.form is Form.HEREDOC:
        return _escape(text, "\\$`")
    if site.form is Form.ANSI_C:
        return _escape(text, "\\'")
    if "'" in text:
        raise SpliceError(f"{text!r} contains `'`, which cannot be written inside '...'")
    return text  # SINGLE_QUOTED, HEREDOC_LITERAL: taken as written


def _directive(text: str) -> str:
    if not _DIRECTIVE_VALUE.match(text):
        raise SpliceError(f"{text!r} cannot be written in an #SBATCH directive")
    return text


def _escape(text: str, characters: str) -> str:
    return "".join("\\" + char if char in characters else char for char in text)


def _bool_text(value: bool, original: str) -> str:
    plain = original.strip("'\"")
    for true, false in _BOOL_STYLES:
        if plain in (true, false):
            return true if value else false
    return "true" if value else "false"


def _config_scalar(form: Form, value: KnobValue, original: str) -> str:
    """A config scalar in `form`, quoted the way the original was when it was a string."""
    quote = original[:1] if original[:1] in {'"', "'"} else ""
    if isinstance(value, bool):
        plain = {Form.PYTHON: ("True", "False")}.get(form, ("true", "false"))[not value]
        if form is Form.YAML:
            plain = _bool_text(value, original)
    else:
        plain = str(value)
    if isinstance(value, bool | int) and not quote:
        return plain
    if quote == "'" and form is not Form.JSON:
        if form is Form.YAML:
            return "'" + plain.replace("'", "''") + "'"
        if "'" in plain:
            raise SpliceError(f"{plain!r} contains `'`, which cannot be written inside '...'")
        return "'" + plain + "'"
    plain_yaml = _YAML_PLAIN.match(plain) and plain.lower() not in _YAML_WORDS
    if form is Form.YAML and not quote and plain_yaml:
        return plain
    if form is Form.PYTHON and not quote:
        return repr(plain)
    return json.dumps(plain, ensure_ascii=True)


# ---------------------------------------------------------------- checking a render


def check_rendered(
    dialect: Dialect, imported: ImportedScript, knobs: Knobs, script: str
) -> list[str]:
    """What is wrong with a rendered script: a changed knob that does not read back as its new
    value, or anything else the analysis reads that moved. Empty when the render is right."""
    files = {path: carried.config.text for path, carried in imported.configs.items()}
    try:
        again = analyse(script, name=imported.file, files=files, knob_names=imported.knob_names)
    except ImporterError as error:
        return [f"the rendered script cannot be analysed: {error}"]
    expected = {reading.knob: reading.value for reading in imported.analysis.knobs}
    for name, managed in imported.managed.items():
        value = knobs[name]
        if managed.source is not None and value != imported.values[name]:
            expected[managed.source] = _expected_text(value)
    problems = []
    for reading in again.knobs:
        if reading.knob is Knob.ALLOC_CONF:
            continue
        want = expected[reading.knob]
        if reading.value != want:
            moved = "moved" if want == imported.analysis.reading(reading.knob).value else "reads"
            problems.append(f"{reading.knob.value} {moved}: {want} -> {reading.value}")
    problems += _env_problems(again, imported, knobs)
    problems += _exclude_problems(dialect, again, imported, knobs)
    problems += _resume_problems(again, imported, knobs)
    return problems


def _expected_text(value: KnobValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _env_problems(again: Analysis, imported: ImportedScript, knobs: Knobs) -> list[str]:
    managed = next((m for m in imported.managed.values() if m.writing is Writing.ENV), None)
    if managed is None:
        return []
    wanted = {k: v for k, v in _pairs(knobs[managed.knob]) if k in ALLOC_CONF_VARIABLES}
    found = {
        occurrence.source: occurrence.value
        for occurrence in again.reading(Knob.ALLOC_CONF).occurrences
    }
    return [
        f"{variable} reads {found.get(variable)!r}, not {value!r}"
        for variable, value in wanted.items()
        if found.get(variable) != value
    ]


def _exclude_problems(
    dialect: Dialect, again: Analysis, imported: ImportedScript, knobs: Knobs
) -> list[str]:
    knob = dialect.knob_for(Role.EXCLUDE)
    if knob is None or knob not in imported.managed:
        return []
    wanted = knobs[knob]
    values = [d.value for d in again.directives if d.option == "exclude" and d.group == 0]
    try:
        nodes = tuple(expand_hostlist(values[0])) if len(values) == 1 else ()
    except SlurmParseError:
        nodes = ()
    if len(values) > 1 or nodes != wanted:
        return [f"the --exclude directive reads {values}, not {wanted}"]
    return []


def _resume_problems(again: Analysis, imported: ImportedScript, knobs: Knobs) -> list[str]:
    """A resume flag the analysis knows (`--resume_from_checkpoint`, `--load`) must reach the
    training command; others (`--load_dir`) go where the same insertion point put these."""
    problems = []
    for name, managed in imported.managed.items():
        if managed.writing is not Writing.RESUME_FLAG or not knobs[name]:
            continue
        if normalise(managed.flag.lstrip("-")) not in RESUME_NAMES:
            continue
        primary = [launch for launch in again.launches if launch.primary]
        if not any(managed.flag in launch.resume_flags for launch in primary):
            problems.append(f"{managed.flag} does not reach the training command")
    return problems


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
