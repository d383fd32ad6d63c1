"""What an operator installs agrees with the code: the units verify, the example config is
the settings' own defaults, every option is in it, and the epilog hook and the node probe
need only the standard library (the probe, Python 3.6's)."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import tomllib
import typing
from configparser import ConfigParser
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from daemon import installable
from daemon.config import Settings, load_settings
from daemon.process import run

DEPLOY = Path(__file__).parents[1] / "deploy"
SHIPPED = Path(installable.__file__).parent
UNIT = SHIPPED / "slurm-medic.service"
WEB_UNIT = SHIPPED / "slurm-medic-web.service"
EXAMPLE = SHIPPED / "config.example.toml"
EPILOG = SHIPPED / "epilog.py"
PROBE = SHIPPED / "node_probe.py"
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


def _imported_roots(tree: ast.AST) -> set[str]:
    """The top-level names of every module the source imports, anywhere in it."""
    return {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }


def test_the_epilog_is_a_stdlib_script_that_knows_the_socket() -> None:
    source = EPILOG.read_text()
    assert source.startswith("#!/usr/bin/python3 -IS\n")
    assert _imported_roots(ast.parse(source)) <= set(sys.stdlib_module_names)
    assert f'DEFAULT_SOCKET = "{Settings().hook_socket}"' in source


# What Python 3.6 lacks that would fail when the probe is compiled or its annotations evaluated.
_NOT_IN_36 = {"__future__"}  # `annotations` is 3.7's
_BUILTIN_GENERICS = {"list", "dict", "tuple", "set", "frozenset", "type"}  # subscripted: 3.9


def _annotations(tree: ast.AST) -> list[ast.expr]:
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            found.append(node.annotation)
        if isinstance(node, ast.FunctionDef) and node.returns is not None:
            found.append(node.returns)
    return found


def test_the_node_probe_is_python_36_and_the_standard_library_only() -> None:
    source = PROBE.read_text()
    assert source.startswith("#!/usr/bin/env python3\n")
    tree = ast.parse(source, feature_version=(3, 6))
    roots = _imported_roots(tree)
    assert roots <= set(sys.stdlib_module_names) - _NOT_IN_36
    annotations = _annotations(tree)
    assert annotations  # the walk sees them
    for annotation in annotations:
        for node in ast.walk(annotation):
            assert not isinstance(node, ast.BinOp), ast.unparse(annotation)  # X | Y: 3.10
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                assert node.value.id not in _BUILTIN_GENERICS, ast.unparse(annotation)


def test_the_shipped_programs_import_without_any_installed_package() -> None:
    """With no site-packages at all (-S), only the standard library and `daemon` itself load."""
    check = (
        "import json, sys, daemon.installable.epilog, daemon.installable.node_probe;"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules}"
        " - set(sys.stdlib_module_names))))"
    )
    result = run([sys.executable, "-S", "-c", check], timeout=60, cwd=str(SHIPPED.parents[1]))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["__main__", "daemon"]
