"""`slurm-medic run`: the daemon (or one cycle of it with `--once`)."""

from __future__ import annotations

import click
from sqlalchemy.exc import DBAPIError

from daemon.config import ConfigError, load_settings
from daemon.ssh import UnsafeKey
from daemon.store.engine import RecordUnavailable, describe_failure, normalise_url
from daemon.store.schema import SchemaBehind

EXIT_CONFIG = 2
EXIT_SCHEMA = 3  # the record is not usable: at another schema, missing or unreachable


@click.command("run")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Config TOML.")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--poll-interval", type=float, help="Seconds between cycles (overrides config).")
@click.option("--dry-run", is_flag=True, default=None, help="Propose only; never act.")
def run_command(
    config_file: str | None, once: bool, poll_interval: float | None, dry_run: bool | None
) -> None:
    """Watch Slurm, diagnose failed jobs, act on approved fixes, verify relaunches."""
    from daemon.service import configure_logging, daemon_from_settings  # noqa: PLC0415

    overrides: dict[str, dict[str, object]] = {}
    if poll_interval is not None:
        overrides["watcher"] = {"poll_interval_s": poll_interval}
    if dry_run:
        overrides["policy"] = {"dry_run": True}
    try:
        settings = load_settings(config_file, overrides=overrides)
    except ConfigError as error:
        click.echo(f"slurm-medic run: {error}", err=True)
        raise SystemExit(EXIT_CONFIG) from error
    configure_logging()
    try:
        with daemon_from_settings(settings) as daemon:
            try:
                daemon.run(once=once)
            except DBAPIError as error:
                # Only a failure before the first cycle gets here (cycles retry their own):
                # one line naming the record, never the driver's traceback or the password.
                url = normalise_url(settings.store.url)
                click.echo(f"slurm-medic run: {describe_failure(error, url)}", err=True)
                raise SystemExit(EXIT_SCHEMA) from error
            except (SchemaBehind, RecordUnavailable) as error:
                click.echo(f"slurm-medic run: {error}", err=True)
                raise SystemExit(EXIT_SCHEMA) from error
    except UnsafeKey as error:  # the probe key, checked as the prober is made
        click.echo(f"slurm-medic run: {error}", err=True)
        raise SystemExit(EXIT_CONFIG) from error
