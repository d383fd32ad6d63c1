"""`slurm-medic template ...`: analyse or import a script, show, render and diff revisions.

A template lives in a directory (`template.toml` + the Jinja2 script); its revisions are JSON
files under `revisions/` in that directory (see daemon.templates.RevisionDir). The directory is
read as the caller, through the same walk and caps as the daemon's reads as an owner.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path
from typing import NoReturn

import click

from daemon.commands.import_report import (
    DOCUMENT_KEYS,
    ScriptUnreadable,
    caller_reader,
    gather,
    read_script,
    report_document,
    report_lines,
)
from daemon.commands.terminal import printable, printable_json
from daemon.dialects import DIALECTS
from daemon.dialects.base import KnobError
from daemon.importer import ImporterError, Knob, parse_knob_mapping
from daemon.owner_files import TEMPLATE_FILE, Owner
from daemon.templates import (
    SCRIPT_FILE,
    KnobChange,
    Patch,
    RevisionDir,
    TemplateError,
    apply_patch,
    diff_revisions,
    import_script,
    initial_revision,
    knobs_to_json,
    load_template,
    parse_knob_text,
)

_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TEMPLATE_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
EXIT_UNREADABLE = 3  # as `diagnose`: the input could not be read


@click.group("template")
def template_group() -> None:
    """Launch templates: analyse, import, show, render, set, diff."""


@template_group.command("analyse", epilog=f"JSON keys (--json):\n\n{DOCUMENT_KEYS}")
@click.argument("script")
@click.option(
    "--knob",
    "mappings",
    multiple=True,
    metavar="KNOB=FLAG",
    help="a flag or key of the script's own program that sets a knob, e.g."
    " micro_batch=--batch_size (repeat for several)",
)
@click.option(
    "--checkpoint-dir",
    metavar="DIR",
    help="the absolute directory the run writes its checkpoints to, when the script does not say",
)
@click.option(
    "--submit-dir",
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
    if checkpoint_dir is not None and not posixpath.isabs(checkpoint_dir):
        raise click.BadParameter("an absolute path", param_hint="--checkpoint-dir")
    location = posixpath.abspath(script)
    directory = posixpath.abspath(submit_dir) if submit_dir else posixpath.dirname(location)
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
        _fail(str(error), EXIT_UNREADABLE)
    document = report_document(gathered, checkpoint_dir)
    if as_json:
        click.echo(printable_json(document))
        return
    for line in report_lines(document):
        click.echo(line)


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


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"slurm-medic template analyse: {printable(message)}", err=True)
    raise SystemExit(code)


@template_group.command("import")
@click.argument("script", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--dialect", "dialect_name", required=True, type=click.Choice(sorted(DIALECTS)))
@click.option("--name", required=True, help="template name (also its directory name)")
@click.option(
    "--into",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("templates"),
    show_default=True,
    help="directory that will hold the new template's directory",
)
def import_command(script: Path, dialect_name: str, name: str, into: Path) -> None:
    """Turn an existing sbatch SCRIPT into a template, reporting what was recognised."""
    if not _TEMPLATE_NAME.match(name):
        raise click.BadParameter("letters, digits, '_', '.', '-' only", param_hint="--name")
    target = into / name
    if target.exists():
        raise click.ClickException(f"{target} already exists")
    try:
        text = script.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise click.ClickException(f"cannot read {script}: {error}") from error

    def read_beside(path: str) -> str:
        candidate = Path(path)
        return (candidate if candidate.is_absolute() else script.parent / candidate).read_text()

    try:
        result = import_script(text, dialect_name=dialect_name, name=name, read_file=read_beside)
    except (TemplateError, KnobError) as error:
        raise click.ClickException(str(error)) from error
    target.mkdir(parents=True)
    (target / TEMPLATE_FILE).write_text(result.toml_text)
    (target / SCRIPT_FILE).write_text(result.script_source)
    template = load_template(target)
    first = initial_revision(template)
    RevisionDir(template).save(first)
    click.echo(f"template {name} ({dialect_name}) written to {target}, revision {first.id}")
    click.echo("recognised:")
    for item in result.recognised:
        click.echo(
            f"  {item.knob} = {json.dumps(knobs_to_json({'v': item.value})['v'])}  ({item.source})"
        )
    if result.defaulted:
        click.echo(f"not in the script, defaulted: {', '.join(result.defaulted)}")
    if result.kept:
        click.echo("not recognised, kept as written:")
        for line in result.kept:
            click.echo(f"  {line}")
    for note in result.notes:
        click.echo(f"note: {note}")


@template_group.command("show")
@click.argument("directory", type=_TEMPLATE_DIR)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def show_command(directory: Path, as_json: bool) -> None:
    """Knobs, batch geometry, checkpoint layout and revisions of a template."""
    try:
        template = load_template(directory)
        revisions = RevisionDir(template).all()
        geometry = template.dialect.geometry(template.knobs)
    except (TemplateError, KnobError) as error:
        raise click.ClickException(str(error)) from error
    data = {
        "name": template.name,
        "dialect": template.dialect.name,
        "invariant": template.dialect.invariant,
        "resume": template.dialect.resume_note,
        "global_batch": geometry.global_batch,
        "micro": geometry.micro,
        "accum": geometry.accum,
        "data_parallel": geometry.data_parallel,
        "knobs": knobs_to_json(template.knobs),
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
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"{template.name}  ({template.dialect.title})")
    click.echo(f"invariant: {template.dialect.invariant}")
    click.echo(
        f"batch: global {geometry.global_batch} = micro {geometry.micro} x accum "
        f"{geometry.accum} x data-parallel {geometry.data_parallel}"
    )
    click.echo(f"resume: {template.dialect.resume_note}")
    click.echo("knobs:")
    for spec in template.dialect.knobs:
        value = json.dumps(knobs_to_json({"v": template.knobs[spec.name]})["v"])
        shown = value if spec.is_set(template.knobs[spec.name]) else "(not set)"
        click.echo(f"  {spec.name:32} {shown:24} {spec.description}")
    if template.checkpoint:
        click.echo(
            f"checkpoints: {template.checkpoint.layout.value} under {template.checkpoint.root}"
        )
    click.echo(f"revisions: {len(revisions)}")
    for revision in revisions:
        what = revision.patch.describe() if revision.patch else "first revision"
        click.echo(f"  {revision.id}  parent {revision.parent or '-':16}  {what}")


@template_group.command("render")
@click.argument("directory", type=_TEMPLATE_DIR)
@click.option("--rev", "revision_id", help="a revision id (prefix); default: the template's knobs")
def render_command(directory: Path, revision_id: str | None) -> None:
    """Print the sbatch script of the template, or of one of its revisions."""
    try:
        template = load_template(directory)
        if revision_id is None:
            click.echo(initial_revision(template).script, nl=False)
        else:
            click.echo(RevisionDir(template).load(revision_id).script, nl=False)
    except (TemplateError, KnobError) as error:
        raise click.ClickException(str(error)) from error


@template_group.command("set")
@click.argument("directory", type=_TEMPLATE_DIR)
@click.argument("assignments", nargs=-1, required=True)
@click.option("--reason", required=True, help="why, for the revision's record")
def set_command(directory: Path, assignments: tuple[str, ...], reason: str) -> None:
    """Make a new revision from the newest one by a hand patch: KNOB=VALUE ..."""
    try:
        template = load_template(directory)
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
        raise click.ClickException(str(error)) from error
    store.save(revision)
    click.echo(f"revision {revision.id} (parent {head.id})")
    click.echo(revision.diff, nl=False)


@template_group.command("diff")
@click.argument("directory", type=_TEMPLATE_DIR)
@click.argument("rev_a")
@click.argument("rev_b")
def diff_command(directory: Path, rev_a: str, rev_b: str) -> None:
    """Unified diff of the rendered scripts of two revisions."""
    try:
        template = load_template(directory)
        store = RevisionDir(template)
        first, second = store.load(rev_a), store.load(rev_b)
    except (TemplateError, KnobError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(diff_revisions(first, second), nl=False)
