"""`slurm-medic db`: bring the record's schema to this code's version, or say where it is."""

from __future__ import annotations

import click
from sqlalchemy import Engine

from daemon.config import ConfigError, load_settings
from daemon.store import schema
from daemon.store.engine import StoreConfigError, make_engine
from daemon.store.settings import StoreSettings

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


def _engine(config_path: str | None, database_url: str | None) -> Engine:
    """The record the other commands would use: --database, else the config's store."""
    try:
        if database_url is not None:
            store = StoreSettings(url=database_url)
        else:
            store = load_settings(config_path).store
    except ConfigError as error:
        raise click.ClickException(str(error)) from error
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--database") from error
    try:
        return make_engine(store)
    except (ValueError, StoreConfigError) as error:
        raise click.BadParameter(str(error), param_hint="--database") from error


@click.group()
def db() -> None:
    """Manage the record's database schema (Alembic migrations shipped with slurm-medic)."""


@db.command("upgrade")
@click.argument("revision", default="head")
@_CONFIG_OPTION
@_DATABASE_OPTION
def upgrade_command(revision: str, config_path: str | None, database_url: str | None) -> None:
    """Migrate the record up to REVISION (default: head, this code's version)."""
    engine = _engine(config_path, database_url)
    try:
        before = schema.current_revision(engine)
        schema.upgrade(engine, revision)
        after = schema.current_revision(engine)
    finally:
        engine.dispose()
    click.echo(f"record schema: {before or 'empty'} -> {after}")


@db.command("downgrade")
@click.argument("revision")
@_CONFIG_OPTION
@_DATABASE_OPTION
def downgrade_command(revision: str, config_path: str | None, database_url: str | None) -> None:
    """Migrate the record down to REVISION (`base` removes every table, data included)."""
    engine = _engine(config_path, database_url)
    try:
        before = schema.current_revision(engine)
        schema.downgrade(engine, revision)
        after = schema.current_revision(engine)
    finally:
        engine.dispose()
    click.echo(f"record schema: {before or 'empty'} -> {after or 'empty'}")


@db.command("current")
@_CONFIG_OPTION
@_DATABASE_OPTION
def current_command(config_path: str | None, database_url: str | None) -> None:
    """Print the record's schema revision and whether it matches this code; exit 1 if not."""
    engine = _engine(config_path, database_url)
    try:
        current = schema.current_revision(engine)
        head = schema.head_revision()
    finally:
        engine.dispose()
    click.echo(f"current: {current or 'empty'}")
    click.echo(f"code head: {head}")
    if current != head:
        raise click.ClickException(f"the record is not at head; run `{schema.UPGRADE_COMMAND}`")
