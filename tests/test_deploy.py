"""The deploy files agree with the code: the unit verifies, the example config is the
settings' own defaults, every option is in it, and the epilog hook needs only the stdlib."""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
import tomllib
import typing
from configparser import ConfigParser
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from daemon.config import Settings, load_settings
from daemon.process import run

DEPLOY = Path(__file__).parents[1] / "deploy"
UNIT = DEPLOY / "systemd" / "slurm-medic.service"
WEB_UNIT = DEPLOY / "systemd" / "slurm-medic-web.service"
EXAMPLE = DEPLOY / "config.example.toml"
EPILOG = DEPLOY / "epilog" / "slurm-medic-epilog"
_DISABLED_OPTION = re.compile(r"^#(?=\[|[a-z_])", re.MULTILINE)


def _unit(path: Path = UNIT) -> ConfigParser:
    parser = ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def _seconds(value: str) -> float:
    match = re.fullmatch(r"([0-9.]+)(s|min)?", value)
    assert match, value
    return float(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_the_unit_is_a_notify_service_with_a_watchdog_the_daemon_can_feed() -> None:
    service = _unit()["Service"]
    assert service["Type"] == "notify"
    assert service["ExecStart"].split()[1:] == ["run", "--config", "/etc/slurm-medic/config.toml"]
    ping_interval = max(1.0, Settings().watcher.poll_interval_s / 2)
    assert _seconds(service["WatchdogSec"]) >= 4 * ping_interval


def test_the_unit_reads_as_owners_not_past_permissions() -> None:
    service = _unit()["Service"]
    assert set(service["CapabilityBoundingSet"].split()) == {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"}
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["ProtectHome"] == "read-only"
    assert "@system-service" in service["SystemCallFilter"]


def test_the_web_unit_serves_the_page_with_no_capability_at_all() -> None:
    service = _unit(WEB_UNIT)["Service"]
    assert service["ExecStart"].split()[1:] == ["web", "--config", "/etc/slurm-medic/config.toml"]
    assert service["CapabilityBoundingSet"] == ""
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    # Its own runtime directory: the daemon's unit removes /run/slurm-medic when it stops.
    assert service["RuntimeDirectory"] != _unit()["Service"]["RuntimeDirectory"]
    # The example's socket and Open OnDemand's app's default are in that directory.
    socket_dir = f"/run/{service['RuntimeDirectory']}/"
    (example_socket,) = re.findall(r'^#socket = "([^"]+)"$', EXAMPLE.read_text(), re.MULTILINE)
    assert example_socket.startswith(socket_dir)
    forwarder = (DEPLOY / "web" / "ood" / "slurm-medic" / "passenger_wsgi.py").read_text()
    assert f'"{example_socket}"' in forwarder


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("source", [UNIT, WEB_UNIT], ids=lambda path: path.name)
def test_systemd_accepts_the_unit(tmp_path: Path, source: Path) -> None:
    # verify wants ExecStart to exist: point it at this checkout's entry point.
    entry = Path(sys.executable).with_name("slurm-medic")
    unit = tmp_path / source.name
    unit.write_text(source.read_text().replace("/usr/bin/slurm-medic", str(entry)))
    result = run(["systemd-analyze", "verify", str(unit)], timeout=60)
    assert result.returncode == 0, result.stderr
    assert source.name not in result.stderr


def test_the_example_config_is_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("SLURM_MEDIC_")]:
        monkeypatch.delenv(name)
    loaded = load_settings(EXAMPLE)
    assert loaded.model_dump() == Settings().model_dump()


def _options(model: type[BaseModel], prefix: str = "") -> set[str]:
    names: set[str] = set()
    for name, field in model.model_fields.items():
        candidates = (field.annotation, *typing.get_args(field.annotation))
        nested = [
            arg
            for arg in candidates
            if typing.get_origin(field.annotation) is not dict
            and isinstance(arg, type)
            and issubclass(arg, BaseModel)
        ]
        if nested:
            names |= _options(nested[0], f"{prefix}{name}.")
        else:
            names.add(prefix + name)
    return names


def _flatten(document: dict[str, Any], prefix: str = "") -> set[str]:
    names: set[str] = set()
    for key, value in document.items():
        if isinstance(value, dict) and key not in ("xid_overrides", "max_attempts_by_lever"):
            names |= _flatten(value, f"{prefix}{key}.")
        else:
            names.add(prefix + key)
    return names


def test_every_option_is_in_the_example_and_each_is_real(tmp_path: Path) -> None:
    key, known_hosts = tmp_path / "key", tmp_path / "known_hosts"
    key.write_text("not read here")
    known_hosts.write_text("")
    enabled = _DISABLED_OPTION.sub("", EXAMPLE.read_text())
    enabled = enabled.replace("/etc/slurm-medic/probe_ed25519", str(key))
    enabled = enabled.replace("/etc/slurm-medic/known_hosts", str(known_hosts))
    path = tmp_path / "config.toml"
    path.write_text(enabled)
    assert _flatten(tomllib.loads(enabled)) == _options(Settings)
    settings = load_settings(path)
    assert settings.probe is not None
    assert settings.probe.key_path == key


def test_the_epilog_is_an_executable_stdlib_script_that_knows_the_socket() -> None:
    assert os.access(EPILOG, os.X_OK)
    source = EPILOG.read_text()
    assert source.startswith("#!/usr/bin/python3 -IS\n")
    modules = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
    }
    assert modules <= set(sys.stdlib_module_names)
    assert f'DEFAULT_SOCKET = "{Settings().hook_socket}"' in source
