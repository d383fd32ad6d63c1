"""`slurm-medic db`: bring the record's schema to this code's version, or say where it is.

Settings and the record come from the command context (`context.CommandContext`), as for
every command: a refused `--config`, `--database` or variable exits 2, a record that cannot be
used exits 4 in one line.
"""

from __future__ import annotations

import click

from daemon.commands.context import (
    CommandContext,
    MissingRecord,
    config_option,
    database_option,
)
from daemon.store import schema
from daemon.store.engine import UPGRADE_COMMAND, Access


@click.group()
def db() -> None:
    """Manage the record's database schema (Alembic migrations shipped with slurm-medic).

    Exit codes: 0 done, 1 `current` found the record behind, 2 usage or a refused option,
    4 the record or a migration failed (one line says why).
    """


@db.command("upgrade")
@click.argument("revision", default="head")
@config_option
@database_option
def upgrade_command(revision: str, config_path: str | None, database_url: str | None) -> None:
    """Migrate the record up to REVISION (default: head, this code's version)."""
    context = CommandContext.load(config_path, database_url)
    with context.engine(access=Access.CREATE) as engine:
        before = schema.current_revision(engine)
        schema.upgrade(engine, revision)
        after = schema.current_revision(engine)
    click.echo(f"record schema: {before or 'empty'} -> {after}")


@db.command("downgrade")
@click.argument("revision")
@config_option
@database_option
def downgrade_command(revision: str, config_path: str | None, database_url: str | None) -> None:
    """Migrate the record down to REVISION (`base` removes every table, data included)."""
    context = CommandContext.load(config_path, database_url)
    with context.engine(access=Access.WRITE) as engine:
        before = schema.current_revision(engine)
        schema.downgrade(engine, revision)
        after = schema.current_revision(engine)
    click.echo(f"record schema: {before or 'empty'} -> {after or 'empty'}")


@db.command("current")
@config_option
@database_option
def current_command(config_path: str | None, database_url: str | None) -> None:
    """Print the record's schema revision and whether it matches this code; exit 1 if not.

    It only looks: a SQLite record that is not there is reported empty, never created.
    """
    context = CommandContext.load(config_path, database_url)
    head = schema.head_revision()
    try:
        with context.engine(access=Access.READ) as engine:
            current = schema.current_revision(engine)
    except MissingRecord as error:
        click.echo(f"current: empty ({error.message})")
        current = None
    else:
        click.echo(f"current: {current or 'empty'}")
    click.echo(f"code head: {head}")
    if current != head:
        raise click.ClickException(f"the record is not at head; run `{UPGRADE_COMMAND}`")
