"""`slurm-medic doctor`: after installing, whether slurm-medic can work on this host.

One line per item, ok / warn / fail, with the fact and, for a warn or a fail, what to do: the
config, the record, Slurm (slurmctld and its release), accounting (sacct through slurmdbd),
the probe (one real probe of one node), the epilog hook (EpilogSlurmctld), the hook socket and
the web page. Each check has its own time limit and none stops another (daemon/doctor/).
The config is read as every command reads it (`context.CommandContext`): under sudo only the
system config counts.

Exit codes:
  0  nothing failed (a warning is something optional not set up, or not known)
  1  something failed
  2  usage error, or --config refused under sudo
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import click

from daemon.commands.context import (
    CommandContext,
    CommandFailed,
    Output,
    Refused,
    config_option,
    echo_lines,
    json_option,
)
from daemon.config import Settings
from daemon.config import config_path as config_file
from daemon.doctor.facts import ConfigFact
from daemon.doctor.gather import gather
from daemon.doctor.judge import judge
from daemon.evidence.prober import NODE_NAME

_NAME_WIDTH = 12


@click.command("doctor")
@config_option
@click.option(
    "--node",
    metavar="NODE",
    default=None,
    help="Probe this node (default: the first node slurmctld lists that is up).",
)
@json_option
def doctor_command(config_path: str | None, node: str | None, as_json: bool) -> None:
    """Check, item by item, that slurm-medic can work here; exit 1 if anything failed."""
    if node is not None and not NODE_NAME.fullmatch(node):
        raise click.BadParameter(f"not a node name: {node[:80]!a}", param_hint="--node")
    path = config_file(config_path, os.environ)
    settings: Settings | None = None
    error: str | None = None
    try:
        settings = CommandContext.load(config_path).settings
    except Refused:
        raise
    except CommandFailed as failure:  # what doctor is for: said as its first item
        error = failure.format_message()
    report = judge(gather(ConfigFact(path, path.exists(), error), settings, node=node))
    Output(as_json).emit(report.document(), echo_lines(_lines))
    raise SystemExit(report.exit_code)


def _lines(document: dict[str, Any]) -> Iterator[str]:
    for check in document["checks"]:
        yield f"{check['status']:<5} {check['name']:<{_NAME_WIDTH}} {check['fact']}"
        if check["action"]:
            yield f"{'':<5} {'':<{_NAME_WIDTH}} do: {check['action']}"
    failed, warnings = document["failed"], document["warnings"]
    if failed:
        yield f"{failed} failed, {warnings} warning(s)"
    elif warnings:
        yield f"nothing failed; {warnings} warning(s)"
    else:
        yield "all is well"
