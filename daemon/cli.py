"""The `slurm-medic` command: one click group whose command modules load only when used.

Loading lazily keeps `slurm-medic diagnose` from paying for SQLAlchemy and Alembic, which
only the `db` commands need.
"""

from __future__ import annotations

import importlib

import click

from daemon import __version__

# Command name -> "module:attribute" of its click command, one line per area.
COMMANDS: dict[str, str] = {
    "approve": "daemon.commands.people:approve_command",
    "db": "daemon.commands.db:db",
    "diagnose": "daemon.commands.diagnose:diagnose_command",
    "doctor": "daemon.commands.doctor:doctor_command",
    "history": "daemon.commands.record_views:history_command",
    "install": "daemon.commands.install:install_group",
    "nodes": "daemon.commands.nodes:nodes_group",
    "pause": "daemon.commands.people:pause_command",
    "probe": "daemon.commands.probe:probe_command",
    "reject": "daemon.commands.people:reject_command",
    "resume": "daemon.commands.people:resume_command",
    "show": "daemon.commands.record_views:show_command",
    "status": "daemon.commands.record_views:status_command",
    "run": "daemon.commands.run:run_command",
    "submit": "daemon.commands.submit:submit_command",
    "sweep": "daemon.commands.sweep:sweep_command",
    "template": "daemon.commands.template:template_group",
    "web": "daemon.commands.web:web_command",
}


class LazyGroup(click.Group):
    """A click group that imports a command's module the first time the command is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module_name, attribute = COMMANDS[cmd_name].split(":")
        command = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{COMMANDS[cmd_name]} is not a click command")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurm-medic")
def main() -> None:
    """slurm-medic: diagnose GPU out-of-memory deaths of Slurm jobs and relaunch them fixed."""
