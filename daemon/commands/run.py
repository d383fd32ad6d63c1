"""`slurm-medic run`: the daemon (or one cycle of it with `--once`).

Exit codes: 0 stopped; 2 a config or a setting that cannot be used (refused under sudo
too, as every command's: `context.CommandContext`; a metrics address that cannot be listened
on); 3 the record is not usable (at another schema, missing or unreachable). Each failure is
one line, `slurm-medic run: ...`.
"""

from __future__ import annotations

import click
from sqlalchemy.exc import DBAPIError

from daemon.commands.context import CommandContext, config_option
from daemon.notify.outbox import NotifyConfigError
from daemon.ssh import UnsafeKey
from daemon.store.engine import RecordUnavailable, describe_failure, normalise_url
from daemon.store.schema import SchemaBehind

EXIT_CONFIG = 2
EXIT_SCHEMA = 3  # the record is not usable: at another schema, missing or unreachable


@click.command("run")
@config_option
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--poll-interval", type=float, help="Seconds between cycles (overrides config).")
@click.option("--dry-run", is_flag=True, default=None, help="Propose only; never act.")
def run_command(
    config_path: str | None, once: bool, poll_interval: float | None, dry_run: bool | None
) -> None:
    """Watch Slurm, diagnose failed jobs, act on approved fixes, verify relaunches."""
    from daemon.logs import configure_logging  # noqa: PLC0415
    from daemon.metrics.serve import MetricsListenError  # noqa: PLC0415
    from daemon.service import daemon_from_settings  # noqa: PLC0415

    overrides: dict[str, dict[str, object]] = {}
    if poll_interval is not None:
        overrides["watcher"] = {"poll_interval_s": poll_interval}
    if dry_run:
        overrides["policy"] = {"dry_run": True}
    context = CommandContext.load(
        config_path, overrides=overrides, prefix="slurm-medic run", config_exit=EXIT_CONFIG
    )
    configure_logging()
    try:
        with daemon_from_settings(context.settings) as daemon:
            try:
                daemon.run(once=once)
            except DBAPIError as error:
                # Only a failure before the first cycle gets here (cycles retry their own):
                # one line naming the record, never the driver's traceback or the password.
                url = normalise_url(context.settings.store.url)
                raise context.fail(describe_failure(error, url), exit_code=EXIT_SCHEMA) from error
            except (SchemaBehind, RecordUnavailable) as error:
                raise context.fail(str(error), exit_code=EXIT_SCHEMA) from error
    except UnsafeKey as error:  # the probe key, checked as the prober is made
        raise context.fail(str(error), exit_code=EXIT_CONFIG) from error
    except MetricsListenError as error:  # [metrics] listen: in use, or not this host's
        raise context.fail(error.strerror or str(error), exit_code=EXIT_CONFIG) from error
    except NotifyConfigError as error:  # [notify]'s mail map or webhook file, read at start
        raise context.fail(str(error), exit_code=EXIT_CONFIG) from error
