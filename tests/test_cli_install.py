"""`slurm-medic install ...` writes the package's own files with their modes, whatever the
umask, and refuses a bad destination in one line: never through a link, never over the
operator's config, never into a directory that is not there."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from daemon import installable
from daemon.cli import main

SHIPPED = Path(installable.__file__).parent
# command -> (the shipped file it writes, its mode)
FILES = {
    "node-probe": ("node_probe.py", 0o755),
    "epilog": ("epilog.py", 0o755),
    "config": ("config.example.toml", 0o600),
}
UNITS = ("slurm-medic.service", "slurm-medic-web.service")


@pytest.fixture(autouse=True)
def strict_umask() -> Iterator[None]:
    """A umask that would leave 0700 of a 0755 file made with open()'s mode alone."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def install(*args: str | Path) -> Result:
    return CliRunner().invoke(main, ["install", *map(str, args)])


def refused(result: Result, why: str) -> None:
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("slurm-medic install: not written: "), line
    assert why in line
    assert "Traceback" not in result.output


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize("command", sorted(FILES))
def test_each_file_is_the_shipped_one_with_its_mode(tmp_path: Path, command: str) -> None:
    shipped, wanted = FILES[command]
    dest = tmp_path / "out"
    result = install(command, dest)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {dest} ({wanted:04o})\n"
    assert dest.read_bytes() == (SHIPPED / shipped).read_bytes()
    assert mode(dest) == wanted
    assert os.listdir(tmp_path) == ["out"]  # no temporary left behind


def test_units_writes_both_units_0644(tmp_path: Path) -> None:
    result = install("units", tmp_path)
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == sorted(UNITS)
    for unit in UNITS:
        assert (tmp_path / unit).read_bytes() == (SHIPPED / unit).read_bytes()
        assert mode(tmp_path / unit) == 0o644


def test_an_existing_config_is_never_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "config.toml"
    dest.write_text("[policy]\ndry_run = true\n")
    refused(install("config", dest), "exists; it is left as it is")
    assert dest.read_text() == "[policy]\ndry_run = true\n"
    assert os.listdir(tmp_path) == ["config.toml"]


def test_a_program_replaces_the_old_one_by_rename_never_writing_into_it(tmp_path: Path) -> None:
    """An upgrade: the old file's inode (and any other name it has) keeps its bytes."""
    dest, other_name = tmp_path / "medic-node-probe", tmp_path / "elsewhere"
    dest.write_text("old probe")
    dest.chmod(0o644)
    os.link(dest, other_name)
    assert install("node-probe", dest).exit_code == 0
    assert dest.read_bytes() == (SHIPPED / "node_probe.py").read_bytes()
    assert mode(dest) == 0o755
    assert other_name.read_text() == "old probe"


@pytest.mark.parametrize("command", [*sorted(FILES), "units"])
def test_a_symlink_at_the_destination_is_refused_and_its_target_untouched(
    tmp_path: Path, command: str
) -> None:
    target = tmp_path / "target"
    target.write_text("root's file")
    target.chmod(0o640)
    link = tmp_path / (UNITS[0] if command == "units" else "dest")
    link.symlink_to(target)
    refused(install(command, tmp_path if command == "units" else link), "is a symbolic link")
    assert link.is_symlink()
    assert target.read_text() == "root's file"
    assert mode(target) == 0o640
    assert sorted(os.listdir(tmp_path)) == sorted(["target", link.name])


def test_a_dangling_symlink_is_refused_and_nothing_made_where_it_points(tmp_path: Path) -> None:
    link = tmp_path / "config.toml"
    link.symlink_to(tmp_path / "made-through-the-link")
    refused(install("config", link), "is a symbolic link")
    assert not (tmp_path / "made-through-the-link").exists()


@pytest.mark.parametrize(
    ("command", "dest", "why"),
    [
        ("epilog", "a-directory", "is a directory; give the file's path"),
        ("config", "missing/config.toml", "no directory"),
        ("node-probe", "a-file/medic-node-probe", "Not a directory"),
        ("units", "a-file", "is not a directory"),
        ("units", "missing", "is not a directory"),
    ],
)
def test_a_bad_destination_is_refused_in_one_line(
    tmp_path: Path, command: str, dest: str, why: str
) -> None:
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "a-file").write_text("x")
    refused(install(command, tmp_path / dest), why)
    assert sorted(os.listdir(tmp_path)) == ["a-directory", "a-file"]
    assert os.listdir(tmp_path / "a-directory") == []
