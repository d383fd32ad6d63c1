"""The command group: every registered command resolves, and none loads before it is used."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from daemon.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_registered_command_resolves_under_its_own_name(name: str) -> None:
    command = main.get_command(click.Context(main), name)
    assert isinstance(command, click.Command)
    assert command.name == name


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    listed = {line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line}
    assert listed == set(COMMANDS)


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["no-such-command"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_importing_the_cli_loads_no_database_layer() -> None:
    probe = "import sys, daemon.cli; print('sqlalchemy' in sys.modules, 'alembic' in sys.modules)"
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert output.split() == ["False", "False"]
