"""`slurm-medic install ...`: write, from the package, what an operator installs outside it.

The node probe, the epilog hook, the two systemd units and the example config live in
`daemon.installable`, one copy each; these commands write them where the operator says, so
what runs on a node or in slurmctld is this version's own, byte for byte. They run as root
into system directories, so the file is never written through a link or into an existing
inode: it is made under a fresh name in the destination's directory (O_CREAT|O_EXCL|O_NOFOLLOW,
as `templates.safe_files` does) with its final mode whatever the umask, then renamed over its
name relative to the directory's descriptor (the directory itself is the operator's choice,
links and all). The config is linked into place instead of renamed, so an existing one (the
operator's edits) is never replaced, even by a race. A link, a directory or anything but a
regular file at the name is refused, as is a missing directory: one line on stderr, exit 1.
"""

from __future__ import annotations

import os
import stat
from contextlib import suppress
from importlib.resources import files
from pathlib import Path

import click

from daemon.commands.context import CommandFailed
from daemon.templates.safe_files import open_fresh

SHIPPED = "daemon.installable"
NODE_PROBE = "node_probe.py"
EPILOG = "epilog.py"
UNITS = ("slurm-medic.service", "slurm-medic-web.service")
CONFIG_EXAMPLE = "config.example.toml"
PREFIX = "slurm-medic install"
EXIT_NOT_WRITTEN = 1
PROGRAM_MODE = 0o755
UNIT_MODE = 0o644
CONFIG_MODE = 0o600  # the store URL may carry a password
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class InstallRefused(Exception):
    """A file that was not written, and why; the message names it."""


def shipped(name: str) -> bytes:
    """The bytes of one of `daemon.installable`'s files, as the package installed them."""
    return files(SHIPPED).joinpath(name).read_bytes()


def install_file(dest: Path, data: bytes, *, mode: int, replace: bool) -> None:
    """Write `data` at `dest` with exactly `mode`, atomically and never through a link; with
    `replace` false an existing file is left as it is and the write refused."""
    directory, name = os.path.split(os.path.abspath(dest))
    if not name:
        raise InstallRefused(f"not written: {dest} is not a file's path")
    try:
        dir_fd = os.open(directory, _DIRECTORY)
    except FileNotFoundError as error:
        raise InstallRefused(f"not written: {dest}: no directory {directory}") from error
    except OSError as error:
        raise InstallRefused(f"not written: {dest}: {directory}: {error.strerror}") from error
    try:
        _check_name(dir_fd, name, dest, replace=replace)
        temporary = _new_file(dir_fd, data, mode)
        try:
            if replace:
                os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            else:
                os.link(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=dir_fd)
    except FileExistsError as error:  # made between the check and the link
        raise InstallRefused(f"not written: {dest} exists; it is left as it is") from error
    except OSError as error:
        raise InstallRefused(f"not written: {dest}: {error.strerror or error}") from error
    finally:
        os.close(dir_fd)


def _check_name(dir_fd: int, name: str, dest: Path, *, replace: bool) -> None:
    """Refuse what must not be written over: anything but a regular file, and, without
    `replace`, a file at all. A link made after this check is replaced by the rename, never
    followed."""
    try:
        status = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(status.st_mode):
        raise InstallRefused(f"not written: {dest} is a symbolic link; give the real path")
    if stat.S_ISDIR(status.st_mode):
        raise InstallRefused(f"not written: {dest} is a directory; give the file's path")
    if not stat.S_ISREG(status.st_mode):
        raise InstallRefused(f"not written: {dest} exists and is not a regular file")
    if not replace:
        raise InstallRefused(f"not written: {dest} exists; it is left as it is")


def _new_file(dir_fd: int, data: bytes, mode: int) -> str:
    """A fresh file of an unpredictable name in the directory holding `data` with `mode`; its
    name. Made 0600, given `mode` once written, then synced."""
    fresh = open_fresh(dir_fd, 0o600)
    if fresh is None:
        raise InstallRefused("not written: no fresh temporary name in the directory")
    fd, temporary = fresh
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    return temporary


def _install(dest: Path, name: str, *, mode: int, replace: bool = True) -> None:
    try:
        install_file(dest, shipped(name), mode=mode, replace=replace)
    except InstallRefused as error:
        raise CommandFailed(str(error), exit_code=EXIT_NOT_WRITTEN, prefix=PREFIX) from error
    click.echo(f"wrote {dest} ({mode:04o})")


@click.group("install")
def install_group() -> None:
    """Write the node probe, the epilog hook, the systemd units or the example config."""


@install_group.command("node-probe")
@click.argument("dest", type=click.Path(path_type=Path))
def node_probe_command(dest: Path) -> None:
    """The node probe, standalone, 0755.

    The program of the service key's forced command on each node (Python 3.6+, standard
    library only), for nodes without slurm-medic: see deploy/node-probe/README.md."""
    _install(dest, NODE_PROBE, mode=PROGRAM_MODE)


@install_group.command("epilog")
@click.argument("dest", type=click.Path(path_type=Path))
def epilog_command(dest: Path) -> None:
    """The EpilogSlurmctld hook, standalone, 0755.

    Run by the system's python3, isolated; name DEST in slurm.conf's EpilogSlurmctld."""
    _install(dest, EPILOG, mode=PROGRAM_MODE)


@install_group.command("units")
@click.argument("directory", type=click.Path(path_type=Path))
def units_command(directory: Path) -> None:
    """The two systemd units into DIRECTORY, 0644.

    slurm-medic.service (the daemon) and slurm-medic-web.service (the web page)."""
    if not directory.is_dir():
        raise CommandFailed(
            f"not written: {directory} is not a directory",
            exit_code=EXIT_NOT_WRITTEN,
            prefix=PREFIX,
        )
    for unit in UNITS:
        _install(directory / unit, unit, mode=UNIT_MODE)


@install_group.command("config")
@click.argument("dest", type=click.Path(path_type=Path))
def config_command(dest: Path) -> None:
    """The example config, 0600, never over a file.

    Every option at its default, each with what it does; an existing file is left as it is."""
    _install(dest, CONFIG_EXAMPLE, mode=CONFIG_MODE, replace=False)
