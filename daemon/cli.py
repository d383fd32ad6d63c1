"""The `slurm-medic` command: one click group; each area registers its commands below."""

from __future__ import annotations

import click

from daemon import __version__
from daemon.commands.db import db
from daemon.commands.diagnose import diagnose_command
from daemon.commands.probe import probe_command
from daemon.commands.template import template_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurm-medic")
def main() -> None:
    """slurm-medic: diagnose GPU out-of-memory deaths of Slurm jobs and relaunch them fixed."""


# Command registrations (one import and one add_command per area).
main.add_command(db)
main.add_command(diagnose_command)
main.add_command(probe_command)
main.add_command(template_group)
