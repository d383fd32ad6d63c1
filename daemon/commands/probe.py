"""`slurm-medic probe NODE`: run the node probe over SSH now and print the verdict.

Exit codes:
  0  healthy or degraded
  1  faulty (the node should be drained)
  2  usage error (bad option, bad settings, bad node name)
  3  unreachable (no SSH session, a refused host key, or the node's state unreadable)
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from daemon.commands.context import Output, json_option, say
from daemon.commands.paths import typed_path
from daemon.evidence.prober import NodeProber, ProbeSettings
from daemon.evidence.records import ProbeVerdict

EXIT_CODES = {
    ProbeVerdict.HEALTHY: 0,
    ProbeVerdict.DEGRADED: 0,
    ProbeVerdict.FAULTY: 1,
    ProbeVerdict.UNREACHABLE: 3,
}


@click.command("probe")
@click.argument("node")
@click.option(
    "--key",
    "key_path",
    callback=typed_path,
    metavar="FILE",
    envvar="MEDIC_PROBE_KEY",
    required=True,
    help="The service's private key (env MEDIC_PROBE_KEY).",
)
@click.option(
    "--known-hosts",
    "known_hosts_path",
    callback=typed_path,
    metavar="FILE",
    envvar="MEDIC_PROBE_KNOWN_HOSTS",
    required=True,
    help="The operator's known_hosts for the nodes (env MEDIC_PROBE_KNOWN_HOSTS).",
)
@click.option("--user", default="medic", envvar="MEDIC_PROBE_USER", show_default=True)
@click.option("--port", default=22, type=int, envvar="MEDIC_PROBE_PORT", show_default=True)
@click.option(
    "--since-minutes",
    type=click.FloatRange(min=0),
    default=None,
    help="Only kernel events of the last N minutes (default: the whole kernel log).",
)
@click.option(
    "--timeout",
    "command_timeout",
    type=click.FloatRange(min=0.1),
    default=45.0,
    show_default=True,
    help="Seconds the probe may run on the node.",
)
@json_option
def probe_command(
    *,
    node: str,
    key_path: str,
    known_hosts_path: str,
    user: str,
    port: int,
    since_minutes: float | None,
    command_timeout: float,
    as_json: bool,
) -> None:
    """Probe NODE (dmesg XIDs, row remaps, ECC, other processes on the GPUs) and judge it."""
    try:
        settings = ProbeSettings(
            key_path=Path(key_path),
            known_hosts_path=Path(known_hosts_path),
            user=user,
            port=port,
            command_timeout_s=command_timeout,
        )
    except ValidationError as error:
        raise click.UsageError(str(error)) from error
    start = None
    if since_minutes is not None:
        start = datetime.now(UTC) - timedelta(minutes=since_minutes)
    try:
        result = NodeProber(settings).probe(node, start=start)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    Output(as_json).emit(_jsonable(result), say(_text))
    raise SystemExit(EXIT_CODES[result.verdict])


def _text(probe: dict[str, Any]) -> str:
    """The verdict and its reasons (which quote the node's kernel log), from the document."""
    lines = [f"{probe['node']}: {probe['verdict']}"]
    lines += [f"  - {reason}" for reason in probe["reasons"]]
    return "\n".join(lines)


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value
