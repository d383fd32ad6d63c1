"""`slurm-medic template ...`: analyse or import a script, show, render and diff revisions.

A template lives in a directory (`template.toml` + the Jinja2 script, or, when imported, the
user's own script verbatim); its revisions are JSON files under `revisions/` in that directory
(see daemon.templates.revisions.RevisionDir). The directory is read as the caller, through
the same walk and caps as the daemon's reads as an owner; every path is taken as typed, from
the current directory (`paths`). Under sudo the commands are refused: they need nothing of
root, and root's reads and writes for a person would be root's, not the person's.

A template directory is often a user's, and the commands may run as root: every file they
write goes through `safe_files` (an exclusive fresh name renamed into place, never through a
link, made as the user who could steer the path, or refused).

A template's text (its name, values, script) is the user's: what the commands print for a
terminal, failures included, goes through `terminal.printable` (`context.Output`,
`context.CommandFailed`). `render` alone prints the script byte for byte: it is the script.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from daemon.commands.context import CommandFailed, Output, echo_lines, require_own_rights
from daemon.commands.import_gather import (
    Gathered,
    ScriptUnreadable,
    caller_reader,
    gather,
    read_script,
)
from daemon.commands.import_json import (
    DOCUMENT_KEYS,
    NOT_MANAGED,
    configs_json,
    import_document,
    report_document,
)
from daemon.commands.import_report import config_lines, report_lines
from daemon.commands.paths import absolute, typed_path
from daemon.commands.terminal import printable
from daemon.dialects import DIALECTS
from daemon.dialects.base import BatchGeometry, KnobError
from daemon.imported import (
    IMPORTED_SCRIPT,
    config_copies,
    elsewhere_of,
    imported_toml,
    invariant_terms,
)
from daemon.importer import ImporterError, Knob, parse_knob_mapping
from daemon.owner_files import Owner, OwnerFiles
from daemon.owner_serve import TEMPLATE_FILE
from daemon.templates.model import (
    LaunchTemplate,
    TemplateError,
    invariant_known,
    parse_knob_text,
)
from daemon.templates.reading import load_template, parse_template
from daemon.templates.rendering import render
from daemon.templates.revisions import (
    KnobChange,
    Patch,
    RevisionDir,
    TemplateRevision,
    apply_patch,
    diff_revisions,
    initial_revision,
    knobs_to_json,
)
from daemon.templates.safe_files import WriteRefused, make_dirs, write_file, writer_of

_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
EXIT_INVALID = 1  # the template, a revision or a change cannot be used as given
EXIT_UNREADABLE = 3  # as `diagnose`: the input could not be read


@click.group("template")
def template_group() -> None:
    """Launch templates: analyse, import, show, render, set, diff."""
    require_own_rights("slurm-medic template")


_MAPPING_OPTION = click.option(
    "--knob",
    "mappings",
    multiple=True,
    metavar="KNOB=FLAG",
    help="a flag or key of the script's own program that sets a knob, e.g."
    " micro_batch=--batch_size (repeat for several)",
)


@template_group.command("analyse", epilog=f"JSON keys (--json):\n\n{DOCUMENT_KEYS}")
@click.argument("script")
@_MAPPING_OPTION
@click.option(
    "--checkpoint-dir",
    callback=typed_path,
    metavar="DIR",
    help="the directory the run writes its checkpoints to, when the script does not say",
)
@click.option(
    "--submit-dir",
    callback=typed_path,
    metavar="DIR",
    help="the directory the job is submitted from, which relative paths in the script are read"
    " from [default: the script's directory]",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON document (keys below)")
def analyse_command(
    script: str,
    mappings: tuple[str, ...],
    checkpoint_dir: str | None,
    submit_dir: str | None,
    as_json: bool,
) -> None:
    """What slurm-medic reads in an sbatch SCRIPT, before anything is imported.

    Each knob with its value and the line it comes from (every place that sets it, and which
    one wins), the knobs set only at run time, the ones not managed and why, the checkpoint
    directory, where an export or a resume flag would be added, and a one-line verdict. The
    script and the config files it names are read with your rights (regular files only,
    size-capped); a file that is missing or refused is reported, never guessed at.

    Exit codes: 0 analysed (whatever the verdict), 2 usage, 3 the script could not be read.
    """
    knob_names = _knob_names(mappings)
    _, gathered = _gathered(script, submit_dir, knob_names, "analyse")
    _print_report(report_document(gathered, checkpoint_dir), as_json)


def _gathered(
    script: str, submit_dir: str | None, knob_names: dict[str, Knob], command: str
) -> tuple[str, Gathered]:
    """The script's text, read as the caller, and its analysis with the files it names; the
    script is named as typed, and read from the current directory."""
    try:
        location = absolute(script)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="SCRIPT") from error
    directory = submit_dir or os.path.dirname(location)
    read = caller_reader()
    try:
        text = read_script(read, location)
        gathered = gather(
            text,
            name=script,
            read=read,
            submit_dir=directory,
            owner=Owner.current(),
            knob_names=knob_names,
        )
    except ScriptUnreadable as error:
        raise CommandFailed(
            str(error), exit_code=EXIT_UNREADABLE, prefix=f"slurm-medic template {command}"
        ) from error
    return text, gathered


def _print_report(document: dict[str, object], as_json: bool) -> None:
    # The report escapes and cuts the document's raw lines itself (a cut must not split an
    # escape), so it reads the document as gathered.
    Output(as_json).emit(document, echo_lines(lambda _shown: report_lines(document)))


def _knob_names(mappings: tuple[str, ...]) -> dict[str, Knob]:
    names: dict[str, Knob] = {}
    for mapping in mappings:
        try:
            flag, knob = parse_knob_mapping(mapping)
        except ImporterError as error:
            raise click.BadParameter(str(error), param_hint="--knob") from error
        if names.get(flag, knob) is not knob:
            raise click.BadParameter(f"{flag} mapped to two knobs", param_hint="--knob")
        names[flag] = knob
    return names


def _invalid(message: str) -> CommandFailed:
    """`Error: ...` (exit 1), as click has always printed it; the message may quote the
    template's own text, which reaches the terminal escaped."""
    return CommandFailed(message, exit_code=EXIT_INVALID)


@template_group.command("import", epilog=f"JSON keys (--json):\n\n{DOCUMENT_KEYS}")
@click.argument("script")
@click.option("--dialect", "dialect_name", required=True, type=click.Choice(sorted(DIALECTS)))
@click.option("--name", required=True, help="template name (also its directory name)")
@click.option(
    "--into",
    callback=typed_path,
    metavar="DIR",
    default="templates",
    show_default=True,
    help="directory that will hold the new template's directory (INTO/NAME)",
)
@_MAPPING_OPTION
@click.option(
    "--checkpoint-dir",
    callback=typed_path,
    metavar="DIR",
    help="the directory the run writes its checkpoints to, when the script does not say",
)
@click.option(
    "--submit-dir",
    callback=typed_path,
    metavar="DIR",
    help="the directory the job is submitted from [default: the script's directory]",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON document (keys below)")
def import_command(
    script: str,
    *,
    dialect_name: str,
    name: str,
    into: str,
    mappings: tuple[str, ...],
    checkpoint_dir: str | None,
    submit_dir: str | None,
    as_json: bool,
) -> None:
    """Make a template of an existing sbatch SCRIPT, keeping the script exactly as it is.

    INTO/NAME receives the script verbatim (job.sbatch), a copy of each config file the script
    names by a path (configs/NAME: a DeepSpeed JSON, an accelerate or training YAML) and a
    template.toml with the dialect, your --knob mappings and --checkpoint-dir. A knob is managed
    only where the script or a kept config writes its value; every other knob is "not managed"
    and no change will ever touch it. A change of a knob in a config is written into the copy,
    which the rendered script then writes itself at run time (your file is never changed). The
    report
    says, knob by knob, what is managed and where a change would be written, what is not and
    why, and whether a batch-size change could be made (the verdict).

    Exit codes: 0 imported (whatever the verdict), 1 refused, 2 usage, 3 unreadable script.
    """
    if not _TEMPLATE_NAME.match(name):
        raise click.BadParameter("letters, digits, '_', '.', '-' only", param_hint="--name")
    knob_names = _knob_names(mappings)
    target = Path(into) / name
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise _invalid(f"{target} already exists and is not empty: not overwritten")
    text, gathered = _gathered(script, submit_dir, knob_names, "import")
    copies = config_copies(gathered.analysis, script, gathered.texts)
    toml_text = imported_toml(
        name=name,
        dialect=dialect_name,
        knob_names=knob_names,
        elsewhere=elsewhere_of(gathered.analysis, script, [copy.path for copy in copies]),
        checkpoint_dir=checkpoint_dir,
        configs=copies,
    )
    kept = {copy.copy: copy.text for copy in copies}
    try:  # refuse before writing anything
        parse_template(tomllib.loads(toml_text), text, target, kept)
    except (TemplateError, KnobError) as error:
        raise _invalid(str(error)) from error
    try:
        writer = writer_of(target)
        make_dirs(target)
        write_file(target / IMPORTED_SCRIPT, text.encode("utf-8", "surrogateescape"))
        for copy in copies:
            make_dirs((target / copy.copy).parent)
            write_file(target / copy.copy, copy.text.encode("utf-8", "surrogateescape"))
        write_file(target / TEMPLATE_FILE, toml_text.encode("utf-8"))
    except WriteRefused as error:
        raise _invalid(f"{target} not written: {error}") from error
    # Written as the user whose directory it is (root into alice's): read back as them too,
    # as the daemon reads a template, since the files are theirs.
    read = None if writer is None else OwnerFiles(Owner.from_uid(writer)).read_template
    try:
        template = load_template(target, read)
        RevisionDir(template).save(initial_revision(template))
    except TemplateError as error:
        raise _invalid(str(error)) from error
    _print_report(import_document(gathered, template, checkpoint_dir), as_json)


@template_group.command("show")
@click.argument("directory", callback=typed_path)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def show_command(directory: str, as_json: bool) -> None:
    """Knobs, batch geometry, checkpoint layout and revisions of a template."""
    try:
        template = load_template(Path(directory))
        revisions = RevisionDir(template).all()
        known = invariant_known(template.dialect, template.not_managed)
        geometry = template.dialect.geometry(template.knobs) if known else None
    except (TemplateError, KnobError) as error:
        raise _invalid(str(error)) from error
    unmanaged = {knob: f"{NOT_MANAGED}: {why}" for knob, why in template.not_managed.items()}
    configs = configs_json(template)
    data = {
        "name": template.name,
        "dialect": template.dialect.name,
        "imported": template.imported is not None,
        "invariant": template.dialect.invariant,
        "resume": template.dialect.resume_note,
        "global_batch": geometry.global_batch if geometry else None,
        "micro": geometry.micro if geometry else None,
        "accum": geometry.accum if geometry else None,
        "data_parallel": geometry.data_parallel if geometry else None,
        "knobs": {**knobs_to_json(template.knobs), **unmanaged},
        "not_managed": dict(template.not_managed),
        "configs": configs,
        "sbatch": dict(template.sbatch),
        "checkpoint": None
        if template.checkpoint is None
        else {"layout": template.checkpoint.layout.value, "root": template.checkpoint.root},
        "revisions": [
            {
                "id": revision.id,
                "parent": revision.parent,
                "patch": revision.patch.describe() if revision.patch else None,
            }
            for revision in revisions
        ],
    }
    lines = echo_lines(lambda _shown: _show_lines(template, geometry, revisions, configs))
    Output(as_json).emit(data, lines)


def _show_lines(
    template: LaunchTemplate,
    geometry: BatchGeometry | None,
    revisions: list[TemplateRevision],
    configs: list[dict[str, Any]],
) -> Iterator[str]:
    """`show` for a person. The name, the values, the checkpoint root and the revisions'
    changes are the template's own text: each line goes out through `printable`."""
    imported = " (imported: the script is kept as written)" if template.imported else ""
    yield f"{template.name}  ({template.dialect.title}){imported}"
    yield f"invariant: {template.dialect.invariant}"
    if geometry is None:
        terms = [t for t in invariant_terms(template.dialect) if t in template.not_managed]
        yield f"batch: not known ({', '.join(terms)} not managed)"
    else:
        yield (
            f"batch: global {geometry.global_batch} = micro {geometry.micro} x accum "
            f"{geometry.accum} x data-parallel {geometry.data_parallel}"
        )
    yield f"resume: {template.dialect.resume_note}"
    yield "knobs:"
    for spec in template.dialect.knobs:
        if spec.name in template.not_managed:
            why = template.not_managed[spec.name]
            yield f"  {spec.name:32} {printable(f'{NOT_MANAGED}: {why}')}"
            continue
        value = json.dumps(knobs_to_json({"v": template.knobs[spec.name]})["v"])
        shown = value if spec.is_set(template.knobs[spec.name]) else "(not set)"
        # Escaped before the padding, so that the descriptions line up.
        yield f"  {spec.name:32} {printable(shown):24} {spec.description}"
    yield from (line.strip() for line in config_lines(configs))
    if template.checkpoint:
        yield f"checkpoints: {template.checkpoint.layout.value} under {template.checkpoint.root}"
    yield f"revisions: {len(revisions)}"
    for revision in revisions:
        what = revision.patch.describe() if revision.patch else "first revision"
        yield f"  {revision.id}  parent {revision.parent or '-':16}  {what}"


@template_group.command("render")
@click.argument("directory", callback=typed_path)
@click.option("--rev", "revision_id", help="a revision id (prefix); default: the template's knobs")
def render_command(directory: str, revision_id: str | None) -> None:
    """Print the sbatch script of the template, or of one of its revisions, byte for byte.

    This is the script itself, to redirect to a file or pipe to sbatch: its characters are
    printed as they are, escape sequences included. To look at it on a terminal, use `show`
    and `diff`, which escape them.
    """
    try:
        template = load_template(Path(directory))
        if revision_id is None:
            script = render(template)
        else:
            script = RevisionDir(template).load(revision_id).script
    except (TemplateError, KnobError) as error:
        raise _invalid(str(error)) from error
    # Byte for byte: an imported script's bytes that are not UTF-8 come back as they were.
    click.echo(script.encode("utf-8", "surrogateescape"), nl=False)


@template_group.command("set")
@click.argument("directory", callback=typed_path)
@click.argument("assignments", nargs=-1, required=True)
@click.option("--reason", required=True, help="why, for the revision's record")
def set_command(directory: str, assignments: tuple[str, ...], reason: str) -> None:
    """Make a new revision from the newest one by a hand patch: KNOB=VALUE ..."""
    try:
        template = load_template(Path(directory))
        store = RevisionDir(template)
        head = store.head()
        changes = []
        for assignment in assignments:
            knob, equals, text = assignment.partition("=")
            if not equals:
                raise click.BadParameter(f"{assignment!r} is not KNOB=VALUE")
            value = parse_knob_text(template.dialect, knob, text)
            changes.append(KnobChange(knob, head.knobs[knob], value))
        revision = apply_patch(template, head, Patch(tuple(changes), reason))
    except (TemplateError, KnobError, KeyError) as error:
        raise _invalid(str(error)) from error
    store.save(revision)
    click.echo(f"revision {revision.id} (parent {head.id})")
    click.echo(printable(revision.diff), nl=False)  # the script's own text, for a terminal


@template_group.command("diff")
@click.argument("directory", callback=typed_path)
@click.argument("rev_a")
@click.argument("rev_b")
def diff_command(directory: str, rev_a: str, rev_b: str) -> None:
    """Unified diff of the rendered scripts of two revisions, for a terminal: a character
    that could act on it (an escape sequence in the script) is shown escaped, as `\\x1b`."""
    try:
        template = load_template(Path(directory))
        store = RevisionDir(template)
        first, second = store.load(rev_a), store.load(rev_b)
    except (TemplateError, KnobError) as error:
        raise _invalid(str(error)) from error
    click.echo(printable(diff_revisions(first, second)), nl=False)
