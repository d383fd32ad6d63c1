"""The wheel as deploy/README.md, section 1, installs it: built from the checkout, installed
alone into a fresh virtual environment of Debian's python3 (its dependencies from the package
index), and every command it installs run once from there, never from the checkout."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon import __version__
from daemon.cli import COMMANDS
from daemon.process import CommandResult, run

pytestmark = pytest.mark.timeout(900)  # the fixture's pip install, from a cold cache

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"
FIXTURE_BIN = REPO / "deploy" / "devcluster" / "fixture-bin"
HEALTHY = REPO / "deploy" / "devcluster" / "node-states" / "healthy"
COMMAND_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
SHIPPED_FILES = (
    "node_probe.py",
    "epilog.py",
    "slurm-medic.service",
    "slurm-medic-web.service",
    "config.example.toml",
)
# install command -> (its destination under the target directory, the file, its mode)
INSTALLS = {
    "node-probe": ("medic-node-probe", "node_probe.py", 0o755),
    "epilog": ("slurm-medic-epilog", "epilog.py", 0o755),
    "config": ("config.toml", "config.example.toml", 0o600),
}
UNITS = ("slurm-medic.service", "slurm-medic-web.service")
PROBE_TOOLS = {"kernel_log", "gpu_health", "gpus", "compute_apps"}


@dataclass(frozen=True)
class Installed:
    """The fresh environment, and a directory outside the checkout to run its commands in."""

    venv: Path
    shipped: Path  # daemon/installable as the wheel installed it
    work: Path

    def run(
        self, command: str, *args: str | Path, env: Mapping[str, str] = COMMAND_ENV
    ) -> CommandResult:
        argv = [str(self.venv / "bin" / command), *map(str, args)]
        return run(argv, timeout=60, env=env, cwd=str(self.work))


def _copy_build_sources(destination: Path) -> None:
    """What setuptools builds the wheel from, copied so the build writes nothing into the
    checkout (its `build/` and egg-info, shared by whoever else runs there)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    destination.mkdir()
    shutil.copy2(REPO / "pyproject.toml", destination)
    shutil.copy2(REPO / project["project"]["readme"], destination)
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.removesuffix("*")
        shutil.copytree(
            REPO / package, destination / package, ignore=shutil.ignore_patterns("__pycache__")
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    source, wheels, venv, work = root / "source", root / "wheels", root / "venv", root / "work"
    work.mkdir()
    _copy_build_sources(source)
    # The venv's setuptools is the build backend pyproject asks for (>=77): no isolation needed.
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run([*build, "--wheel-dir", str(wheels), str(source)], timeout=300, check=True)
    (wheel,) = wheels.glob("slurm_medic-*.whl")
    run([SYSTEM_PYTHON, "-m", "venv", str(venv)], timeout=120, check=True)
    pip_env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-input", str(wheel)]
    run(pip, timeout=800, check=True, env=pip_env, cwd=str(work))
    where = "import os, daemon.installable as i; print(os.path.dirname(i.__file__))"
    found = run([str(venv / "bin" / "python"), "-c", where], timeout=60, check=True, cwd=str(work))
    return Installed(venv, Path(found.stdout.strip()), work)


@pytest.fixture
def hook_socket(installed: Installed) -> Iterator[tuple[socket.socket, Path]]:
    """A bound datagram socket standing in for the daemon's (sun_path: 108 bytes)."""
    path = installed.work / "hook.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        try:
            yield sock, path
        finally:
            path.unlink()


def test_the_package_and_its_files_come_from_the_wheel(installed: Installed) -> None:
    assert installed.shipped.is_relative_to(installed.venv)
    for name in SHIPPED_FILES:
        installed_file = installed.shipped / name
        assert installed_file.read_bytes() == (REPO / "daemon" / "installable" / name).read_bytes()


def test_version(installed: Installed) -> None:
    result = installed.run("slurm-medic", "--version")
    assert (result.returncode, result.stdout) == (0, f"slurm-medic, version {__version__}\n")


def test_help_loads_every_command_with_the_installed_dependencies(installed: Installed) -> None:
    """--help imports each command's module for its summary: a missing dependency fails here."""
    result = installed.run("slurm-medic", "--help")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line}
    assert listed == set(COMMANDS)
    assert "install" in listed


def test_the_epilog_exits_0_at_once_without_a_daemon(installed: Installed) -> None:
    env = {**COMMAND_ENV, "SLURM_JOB_ID": "48213"}
    env["SLURM_MEDIC_HOOK_SOCKET"] = str(installed.work / "no-daemon.sock")
    started = time.monotonic()
    result = installed.run("slurm-medic-epilog", env=env)
    elapsed = time.monotonic() - started
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert elapsed < 1.5, elapsed  # its own deadline is 0.5 s; the rest is starting Python


def test_the_epilog_sends_the_job_id(
    installed: Installed, hook_socket: tuple[socket.socket, Path]
) -> None:
    sock, path = hook_socket
    env = {**COMMAND_ENV, "SLURM_JOB_ID": "48213", "SLURM_MEDIC_HOOK_SOCKET": str(path)}
    assert installed.run("slurm-medic-epilog", env=env).returncode == 0
    assert sock.recv(64) == b"48213"


def _probe_env() -> dict[str, str]:
    """A node as the dev cluster fakes one: fixture nvidia-smi and dmesg first on PATH."""
    return {
        "PATH": f"{FIXTURE_BIN}:/usr/bin:/bin",
        "MEDIC_FIXTURE_DIR": str(HEALTHY),
        "SSH_ORIGINAL_COMMAND": "rm -rf /",
    }


def _one_probe_document(result: CommandResult) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    document = json.loads(line)
    assert isinstance(document, dict)
    assert document["format"] == "medic-node-probe/1"
    tools = document["tools"]
    assert isinstance(tools, dict)
    assert set(tools) == PROBE_TOOLS
    assert tools["gpus"]["exit_code"] == 0  # the fixture nvidia-smi ran: the tools were reached
    return document


def test_the_node_probe_prints_one_document_whatever_it_is_asked(installed: Installed) -> None:
    _one_probe_document(installed.run("medic-node-probe", "--delete", "/", env=_probe_env()))


def test_each_install_writes_the_installed_files_with_their_modes(installed: Installed) -> None:
    target = installed.work / "etc"
    target.mkdir()
    for command, (dest, name, mode) in INSTALLS.items():
        result = installed.run("slurm-medic", "install", command, target / dest)
        assert result.returncode == 0, result.stderr
        assert (target / dest).read_bytes() == (installed.shipped / name).read_bytes()
        assert stat.S_IMODE((target / dest).stat().st_mode) == mode
    result = installed.run("slurm-medic", "install", "units", target)
    assert result.returncode == 0, result.stderr
    for unit in UNITS:
        assert (target / unit).read_bytes() == (installed.shipped / unit).read_bytes()
        assert stat.S_IMODE((target / unit).stat().st_mode) == 0o644
    assert sorted(os.listdir(target)) == sorted([*UNITS, *(d for d, _, _ in INSTALLS.values())])

    again = installed.run("slurm-medic", "install", "config", target / "config.toml")
    assert again.returncode == 1
    assert again.stderr.startswith("slurm-medic install: not written: ")
    assert len(again.stderr.splitlines()) == 1


def test_the_written_programs_run_by_the_system_python_alone(
    installed: Installed, hook_socket: tuple[socket.socket, Path]
) -> None:
    """What a node or slurmctld's host without slurm-medic runs: the files by their shebangs."""
    target = installed.work / "standalone"
    target.mkdir()
    for command in ("node-probe", "epilog"):
        dest = target / INSTALLS[command][0]
        assert installed.run("slurm-medic", "install", command, dest).returncode == 0
    _one_probe_document(run([str(target / "medic-node-probe")], timeout=60, env=_probe_env()))
    sock, path = hook_socket
    env = {**COMMAND_ENV, "SLURM_JOB_ID": "77", "SLURM_MEDIC_HOOK_SOCKET": str(path)}
    assert run([str(target / "slurm-medic-epilog")], timeout=10, env=env).returncode == 0
    assert sock.recv(64) == b"77"
