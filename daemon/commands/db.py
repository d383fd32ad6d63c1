"""`slurm-medic db`: bring the record's schema to this code's version, or say where it is.

Also the one way every command that uses the record gets its settings and its engine, so
that each refuses the same things in the same words: `--config`, `--database` and
`SLURM_MEDIC_` variables from someone root runs for (exit 2, `config.PrivilegeError`), and a
record that is missing, unreachable, locked, corrupt or at another schema (exit 4, one line,
never a traceback).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from daemon.config import ConfigError, DatabaseUrlError, PrivilegeError, Settings, load_settings
from daemon.store import schema
from daemon.store.engine import (
    UPGRADE_COMMAND,
    Access,
    NoRecord,
    RecordUnavailable,
    StoreConfigError,
    describe_failure,
    make_engine,
)

EXIT_REFUSED = 2
EXIT_RECORD = 4


class Refused(click.ClickException):
    """A setting this caller may not choose (exit 2, like a usage error): the message says why."""

    exit_code = EXIT_REFUSED


class RecordUnusable(click.ClickException):
    """The record cannot be used as it is (exit 4): missing, unreachable, locked, corrupt,
    or at a schema that is not this code's."""

    exit_code = EXIT_RECORD


class MissingRecord(RecordUnusable):
    """The SQLite file is not there (and this command may not create it)."""


def cli_settings(config_path: str | None, database_url: str | None = None) -> Settings:
    """The settings a command runs with: the config, `--database` over its store."""
    try:
        return load_settings(config_path, database=database_url)
    except PrivilegeError as error:
        raise Refused(str(error)) from error
    except DatabaseUrlError as error:
        raise click.BadParameter(str(error), param_hint="--database") from error
    except ConfigError as error:
        raise click.ClickException(str(error)) from error


@contextmanager
def record_engine(settings: Settings, *, access: Access) -> Iterator[Engine]:
    """An engine on the record, disposed of afterwards; a failure of the database, its
    driver or a migration inside the block ends the command with one line (exit 4)."""
    try:
        engine = make_engine(settings.store, access=access)
    except StoreConfigError as error:
        raise click.BadParameter(str(error), param_hint="--database") from error
    except NoRecord as error:
        raise MissingRecord(str(error)) from error
    except RecordUnavailable as error:
        raise RecordUnusable(str(error)) from error
    try:
        yield engine
    except DBAPIError as error:
        raise RecordUnusable(describe_failure(error, engine.url)) from error
    except (RecordUnavailable, schema.SchemaBehind) as error:
        raise RecordUnusable(str(error)) from error
    except (CommandError, RevisionError) as error:
        raise RecordUnusable(f"migration refused: {error}") from error
    finally:
        engine.dispose()


_CONFIG_OPTION = click.option(
    "--config",
    "config_path",
    metavar="FILE",
    default=None,
    help="Config file (default: $SLURM_MEDIC_CONFIG, else /etc/slurm-medic/config.toml).",
)
_DATABASE_OPTION = click.option(
    "--database",
    "database_url",
    metavar="URL",
    default=None,
    help="SQLAlchemy URL of the record, over the config's store.url.",
)


@click.group()
def db() -> None:
    """Manage the record's database schema (Alembic migrations shipped with slurm-medic).

    Exit codes: 0 done, 1 `current` found the record behind, 2 usage or a refused option,
    4 the record or a migration failed (one line says why).
    """


@db.command("upgrade")
@click.argument("revision", default="head")
@_CONFIG_OPTION
@_DATABASE_OPTION
def upgrade_command(revision: str, config_path: str | None, database_url: str | None) -> None:
    """Migrate the record up to REVISION (default: head, this code's version)."""
    settings = cli_settings(config_path, database_url)
    with record_engine(settings, access=Access.CREATE) as engine:
        before = schema.current_revision(engine)
        schema.upgrade(engine, revision)
        after = schema.current_revision(engine)
    click.echo(f"record schema: {before or 'empty'} -> {after}")


@db.command("downgrade")
@click.argument("revision")
@_CONFIG_OPTION
@_DATABASE_OPTION
def downgrade_command(revision: str, config_path: str | None, database_url: str | None) -> None:
    """Migrate the record down to REVISION (`base` removes every table, data included)."""
    settings = cli_settings(config_path, database_url)
    with record_engine(settings, access=Access.WRITE) as engine:
        before = schema.current_revision(engine)
        schema.downgrade(engine, revision)
        after = schema.current_revision(engine)
    click.echo(f"record schema: {before or 'empty'} -> {after or 'empty'}")


@db.command("current")
@_CONFIG_OPTION
@_DATABASE_OPTION
def current_command(config_path: str | None, database_url: str | None) -> None:
    """Print the record's schema revision and whether it matches this code; exit 1 if not.

    It only looks: a SQLite record that is not there is reported empty, never created.
    """
    settings = cli_settings(config_path, database_url)
    head = schema.head_revision()
    try:
        with record_engine(settings, access=Access.READ) as engine:
            current = schema.current_revision(engine)
    except MissingRecord as error:
        click.echo(f"current: empty ({error.message})")
        current = None
    else:
        click.echo(f"current: {current or 'empty'}")
    click.echo(f"code head: {head}")
    if current != head:
        raise click.ClickException(f"the record is not at head; run `{UPGRADE_COMMAND}`")
