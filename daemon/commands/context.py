"""What every command runs with: its settings, its record, its output, and how it fails.

One place decides, for every command, what the issue of three hand-made copies got wrong
in three ways: settings come from `config.load_settings`, so under sudo or a set-id path only
the system config counts and `--config`, `--database`, setting flags and `SLURM_MEDIC_`
variables are refused (exit 2); the record is opened as the command needs it (read-only
SQLite for commands that only look; none of them creates a missing record) and a record
that is missing, unreachable, locked, corrupt or at another schema ends the command in one
line (exit 4), never a traceback; and the answer is one JSON document for a script or text
for a person, with every string from outside passed through `terminal.printable`.

A command's failures read as they always have: the people's and `db` commands in click's
`Error: ...`, the daemon and `submit` as `slurm-medic run: ...` (`prefix`); a config that
cannot be used exits 1 for the former (deploy/README.md) and 2 for the latter.

The settings (pydantic) and the record (SQLAlchemy, Alembic) are imported when a command
asks for them, not with this module: `diagnose --log` and `template` fail and print through
it without paying for either (see daemon/cli.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import click
from rich.console import Console

from daemon.commands.paths import typed_path
from daemon.commands.terminal import printable, printable_document, printable_json
from daemon.privilege import confinement
from daemon.slurm.backend import SlurmCli

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from daemon.config import Settings
    from daemon.store.engine import Access

CLICK_PREFIX = "Error"  # what click.ClickException prints before its message
EXIT_CONFIG = 1  # the people's and db commands: a config that cannot be read
EXIT_REFUSED = 2
EXIT_RECORD = 4

Render = Callable[[Console, Any], None]


class CommandFailed(click.ClickException):
    """One line on stderr, `PREFIX: message`, and the command's exit code."""

    def __init__(self, message: str, *, exit_code: int, prefix: str = CLICK_PREFIX) -> None:
        super().__init__(message)
        self.code = exit_code
        self.prefix = prefix

    # click exits with `exit_code`, a class attribute there; each failure here has its own.
    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return self.code

    def show(self, file: IO[Any] | None = None) -> None:
        # The message may quote what a user wrote (a config value, sbatch's answer).
        line = f"{self.prefix}: {printable(self.format_message())}"
        click.echo(line, file=file, err=file is None)


class Refused(CommandFailed):
    """A setting (or a command) this caller may not choose here (exit 2, like a usage error):
    the message says why."""


class RecordUnusable(CommandFailed):
    """The record cannot be used as it is (exit 4): missing, unreachable, locked, corrupt,
    or at a schema that is not this code's."""


class MissingRecord(RecordUnusable):
    """The SQLite file is not there (and this command may not create it)."""


def require_own_rights(what: str, *, prefix: str = CLICK_PREFIX) -> None:
    """Refuse `what` in a process that runs as root for someone else (sudo, set-id): it works
    on the person's own files only, which needs nothing of root, and root looking at the paths
    they typed would tell them what only root may see (exit 2, as a refused setting)."""
    reason = confinement(os.environ)
    if reason is not None:
        raise Refused(
            f"{reason}: {what} works on your own files with your own rights, not root's;"
            " run it without sudo",
            exit_code=EXIT_REFUSED,
            prefix=prefix,
        )


@dataclass(frozen=True)
class Output:
    """Where a command's answer goes: one JSON document, or text rendered for a person."""

    as_json: bool = False

    def emit(self, document: Any, render: Render) -> None:
        """Print the document for a script or a person; user text reaches neither raw."""
        if self.as_json:
            click.echo(printable_json(document))
            return
        # No emoji codes either: a `:fire:` in a log line is shown as written.
        console = Console(highlight=False, soft_wrap=True, emoji=False)
        render(console, printable_document(document))


def say(line: Callable[[Any], str]) -> Render:
    """A rendering that is one line of plain text (never rich markup) made from the document."""
    return lambda console, shown: console.print(line(shown), markup=False)


def echo_lines(lines: Callable[[Any], Iterable[str]]) -> Render:
    """A rendering in plain lines, each through `printable`, echoed as they are: rich would
    expand the tabs of a quoted script line. `lines` may also read what it closes over."""

    def render(_console: Console, shown: Any) -> None:
        for line in lines(shown):
            click.echo(printable(line))

    return render


@dataclass(frozen=True)
class CommandContext:
    """A command's settings, the way to its record and to its output, and its voice."""

    settings: Settings
    output: Output = Output()
    prefix: str = CLICK_PREFIX

    @classmethod
    def load(
        cls,
        config_path: str | os.PathLike[str] | None,
        database_url: str | None = None,
        *,
        as_json: bool = False,
        overrides: Mapping[str, Any] | None = None,
        prefix: str = CLICK_PREFIX,
        config_exit: int = EXIT_CONFIG,
    ) -> CommandContext:
        """The context of a command given `--config`, `--database` and setting flags."""
        from daemon.config import (  # noqa: PLC0415  (pydantic: only for commands with settings)
            ConfigError,
            DatabaseUrlError,
            PrivilegeError,
            load_settings,
        )

        try:
            settings = load_settings(config_path, database=database_url, overrides=overrides)
        except PrivilegeError as error:
            raise Refused(str(error), exit_code=EXIT_REFUSED, prefix=prefix) from error
        except DatabaseUrlError as error:
            raise click.BadParameter(str(error), param_hint="--database") from error
        except ConfigError as error:
            raise CommandFailed(str(error), exit_code=config_exit, prefix=prefix) from error
        return cls(settings, Output(as_json), prefix)

    def fail(self, message: str, *, exit_code: int) -> CommandFailed:
        """A failure in this command's voice, for the caller to raise."""
        return CommandFailed(message, exit_code=exit_code, prefix=self.prefix)

    def emit(self, document: Any, render: Render) -> None:
        self.output.emit(document, render)

    def slurm(self) -> SlurmCli:
        return SlurmCli(timeout_s=self.settings.slurm_timeout_s)

    @contextmanager
    def engine(self, *, access: Access) -> Iterator[Engine]:
        """An engine on the record, disposed of afterwards; a failure of the database, its
        driver or a migration inside the block ends the command with one line (exit 4)."""
        # The record's layers, only for the commands that open it.
        from alembic.script.revision import RevisionError  # noqa: PLC0415
        from alembic.util import CommandError  # noqa: PLC0415
        from sqlalchemy.exc import DBAPIError  # noqa: PLC0415

        from daemon.store import schema  # noqa: PLC0415
        from daemon.store.engine import (  # noqa: PLC0415
            NoRecord,
            RecordUnavailable,
            StoreConfigError,
            describe_failure,
            make_engine,
        )

        try:
            engine = make_engine(self.settings.store, access=access)
        except StoreConfigError as error:
            raise click.BadParameter(str(error), param_hint="--database") from error
        except NoRecord as error:
            raise MissingRecord(str(error), exit_code=EXIT_RECORD, prefix=self.prefix) from error
        except RecordUnavailable as error:
            raise self._unusable(str(error)) from error
        try:
            yield engine
        except DBAPIError as error:
            raise self._unusable(describe_failure(error, engine.url)) from error
        except (RecordUnavailable, schema.SchemaBehind) as error:
            raise self._unusable(str(error)) from error
        except (CommandError, RevisionError) as error:
            raise self._unusable(f"migration refused: {error}") from error
        finally:
            engine.dispose()

    @contextmanager
    def session(self, *, read_only: bool = False) -> Iterator[Session]:
        """A session on the record at this code's schema; the engine is closed afterwards.

        Commands that only read open SQLite read-only and take a read-only session: they
        never create a record, answer while a daemon step holds SQLite's write lock, and
        cannot write by mistake. No command creates a missing record; `db upgrade` does.
        """
        from daemon.store import schema  # noqa: PLC0415  (as in `engine`)
        from daemon.store.engine import Access, make_session_factory  # noqa: PLC0415

        access = Access.READ if read_only else Access.WRITE
        with self.engine(access=access) as engine:
            schema.check_schema_current(engine)
            with make_session_factory(engine, read_only=read_only)() as session:
                yield session

    def _unusable(self, message: str) -> RecordUnusable:
        return RecordUnusable(message, exit_code=EXIT_RECORD, prefix=self.prefix)


config_option = click.option(
    "--config",
    "config_path",
    callback=typed_path,
    metavar="FILE",
    default=None,
    help="Config file (default: $SLURM_MEDIC_CONFIG, else /etc/slurm-medic/config.toml).",
)
database_option = click.option(
    "--database",
    "database_url",
    metavar="URL",
    default=None,
    help="SQLAlchemy URL of the record, over the config's store.url.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="One JSON document.")


def record_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`--config`, `--database` and `--json`: what every command on the record takes."""
    return config_option(database_option(json_option(command)))
