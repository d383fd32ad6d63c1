"""Writing a file where a user may steer the write: the template commands' one way to write.

Root may write anywhere, and a template directory is usually a user's: a symlink planted at a
name root is about to write (the old `revisions/<id>.tmp`), or a directory swapped for a link
between a check and the write, would have root write where the user chose (`/etc/cron.d`). So:

- a file is written under a fresh, unpredictable name made with O_CREAT|O_EXCL|O_NOFOLLOW (as
  `tempfile.mkstemp`, but relative to a directory descriptor), then renamed over its name with
  `os.replace`, which replaces a link there and never follows it;
- the directory is reached one component at a time from `/`, the kernel following no link (a
  link is read and followed here), and who could change the path decides who writes: no one
  but root (every directory on the way root's and not writable by others, sticky ones aside),
  root writes; one user (the owner of a directory or of a link on the way), the write is made
  as that user, in a child that has become them (`process.as_user_argv`), so the kernel says
  what they may write; two users, or a directory of root's others may write, it is refused.

Not root, the caller writes with its own rights, through the same walk and the same creation.
Every failure is `WriteRefused`, whose message names the path and says why.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import secrets
import stat
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.owner_files import CHILD_ENV
from daemon.process import CommandError, as_user_argv, run

MAX_LINKS = 40  # the kernel's own limit on the links of one lookup
CHILD_TIMEOUT_S = 60.0
_CHILD_MODULE = "daemon.templates.safe_files"
_MAX_ANSWER_BYTES = 64 * 1024
_DIRECTORY = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_NAME_TRIES = 100


class WriteRefused(Exception):
    """A file or directory that was not written, and why."""


class _Steered(Exception):
    """The path is one user's to change: the write is theirs to make (as root, not yet made)."""

    def __init__(self, uid: int) -> None:
        super().__init__(uid)
        self.uid = uid


def write_file(path: Path | str, data: bytes) -> None:
    """Replace the file at `path` with `data`, atomically, never through a link; its directory
    must exist. As root, made as the user who could steer the path (see the module)."""
    _perform({"op": "write", "path": _absolute(path), "data": base64.b64encode(data).decode()})


def make_dirs(path: Path | str) -> None:
    """`mkdir -p path`, never through a link made after the walk; as `write_file` for root."""
    _perform({"op": "make_dirs", "path": _absolute(path)})


def writer_of(path: Path | str) -> int | None:
    """The uid a write at or below `path` would be made as now: None for this process itself
    (not root, or root where no one else could steer the path); WriteRefused where no one may."""
    if os.geteuid() != 0:
        return None
    try:
        walk = _walk(_absolute(path), judge=True)
    except _Steered as steered:
        return steered.uid
    except OSError as error:
        raise WriteRefused(f"cannot write under {path}: {error.strerror or error}") from error
    os.close(walk.fd)
    return None


def _absolute(path: Path | str) -> str:
    """The path from `/`, its `..` left for the walk (after a link, `..` is the link target's
    parent, not the lexical one)."""
    text = os.fspath(path)
    return text if text.startswith("/") else os.path.join(os.getcwd(), text)


def _perform(request: dict[str, Any]) -> None:
    try:
        _serve(request, judge=os.geteuid() == 0)
    except _Steered as steered:
        _as_user(steered.uid, request)


def _serve(request: dict[str, Any], *, judge: bool) -> None:
    """Do what the request asks, here; with `judge` (root), first raise `_Steered` when a user
    could change the path, or `WriteRefused` when more than one could."""
    path = str(request["path"])
    try:
        if request["op"] == "make_dirs":
            _make_dirs(path, judge=judge)
        elif request["op"] == "write":
            _write(path, base64.b64decode(str(request["data"]), validate=True), judge=judge)
        else:
            raise WriteRefused(f"unknown request {request['op']!r}")
    except OSError as error:
        raise WriteRefused(f"cannot write {path}: {error.strerror or error}") from error


def _make_dirs(path: str, *, judge: bool) -> None:
    walk = _walk(path, judge=judge)
    fd = walk.fd
    try:
        for name in walk.missing:
            if name == "..":
                raise WriteRefused(f"cannot make {path}: '..' below a missing directory")
            with suppress(FileExistsError):
                os.mkdir(name, dir_fd=fd)
            below = os.open(name, _DIRECTORY, dir_fd=fd)  # ELOOP when a link took its place
            os.close(fd)
            fd = below
            if judge and os.fstat(fd).st_uid != 0:
                raise WriteRefused(f"cannot make {path}: another user made {name!r} first")
    finally:
        os.close(fd)


def _write(path: str, data: bytes, *, judge: bool) -> None:
    directory, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise WriteRefused(f"cannot write {path}: not a file name")
    walk = _walk(directory, judge=judge)
    try:
        if walk.missing:
            raise WriteRefused(f"cannot write {path}: {directory} does not exist")
        _replace_at(walk.fd, name, data)
    finally:
        os.close(walk.fd)


def open_fresh(directory: int, mode: int) -> tuple[int, str] | None:
    """A new file of an unpredictable name in `directory`, made exclusively (never an existing
    file, never through a link): its descriptor and name, or None when no fresh name was found
    in `_NEW_NAME_TRIES` tries. One way for every write of root's that must not be steered."""
    for _ in range(_NEW_NAME_TRIES):
        temporary = f".slurm-medic-{secrets.token_hex(8)}.tmp"
        try:
            return os.open(temporary, _NEW_FILE, mode, dir_fd=directory), temporary
        except FileExistsError:
            continue
    return None


def _replace_at(directory: int, name: str, data: bytes) -> None:
    """Write `data` to a new file of an unpredictable name in `directory` (`open_fresh`), then
    rename it over `name`."""
    fresh = open_fresh(directory, 0o666)
    if fresh is None:
        raise WriteRefused(f"no fresh temporary name for {name} in {_NEW_NAME_TRIES} tries")
    fd, temporary = fresh
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        raise


# ---------------------------------------------------------------- the walk


@dataclass(frozen=True)
class _Walked:
    """Where the walk stopped: the deepest existing directory (a descriptor for the caller to
    close) and the names below it that are not there yet."""

    fd: int
    missing: list[str]


def _walk(path: str, *, judge: bool) -> _Walked:
    """Open the directory `path` from `/`, component by component, the kernel following no
    link; a link is read and followed here (at most MAX_LINKS). With `judge`, who could change
    the path is found on the way (`_judge`) and raised before anything is written."""
    stack = [os.open("/", _DIRECTORY)]
    steerers: set[int] = set()
    pending = _components(path)
    links = 0
    try:
        if judge:
            _judge(os.fstat(stack[0]), "/", steerers)
        while pending:
            name = pending.pop(0)
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            try:
                status = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            except FileNotFoundError:
                pending.insert(0, name)
                break
            if stat.S_ISLNK(status.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise WriteRefused(f"cannot write under {path}: more than {MAX_LINKS} links")
                if status.st_uid != 0:
                    steerers.add(status.st_uid)
                target = os.readlink(name, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                pending[:0] = _components(target)
                continue
            if not stat.S_ISDIR(status.st_mode):
                raise WriteRefused(f"cannot write under {path}: {name!r} is not a directory")
            fd = os.open(name, _DIRECTORY, dir_fd=stack[-1])
            stack.append(fd)
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (status.st_dev, status.st_ino):
                raise WriteRefused(f"cannot write under {path}: {name!r} changed while walked")
            if judge:
                _judge(opened, name, steerers)
        if judge:
            _decide(path, steerers)
    except BaseException:
        for fd in stack:
            os.close(fd)
        raise
    for fd in stack[:-1]:
        os.close(fd)
    return _Walked(stack[-1], pending)


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _judge(status: os.stat_result, name: str, steerers: set[int]) -> None:
    """Note a directory's owner among who could steer the path; refuse a directory of root's
    that others may write (other than root's group), unless sticky (where each may change only
    their own entries, whose owners are noted in turn)."""
    if status.st_uid != 0:
        steerers.add(status.st_uid)
        return
    mode = status.st_mode
    others_write = mode & stat.S_IWOTH or (mode & stat.S_IWGRP and status.st_gid != 0)
    if others_write and not mode & stat.S_ISVTX:
        raise WriteRefused(f"{name!r} is root's but others may write in it: not written as root")


def _decide(path: str, steerers: set[int]) -> None:
    """Root writes where no one else could steer; else `_Steered` (one user) or a refusal."""
    if not steerers:
        return
    if len(steerers) > 1:
        users = ", ".join(sorted(_user_name(uid) for uid in steerers))
        raise WriteRefused(f"not written: {path} may be changed by more than one user ({users})")
    raise _Steered(next(iter(steerers)))


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# ---------------------------------------------------------------- as the user


def _as_user(uid: int, request: dict[str, Any]) -> None:
    """Serve the request in a child that has become `uid` (root only)."""
    path = str(request["path"])
    try:
        entry = pwd.getpwuid(uid)
    except KeyError as error:
        raise WriteRefused(
            f"cannot write {path}: its owner uid {uid} has no passwd entry"
        ) from error
    argv = as_user_argv(uid, entry.pw_gid, [sys.executable, "-I", "-B", "-m", _CHILD_MODULE])
    try:
        result = run(
            argv,
            timeout=CHILD_TIMEOUT_S,
            input_text=json.dumps(request),
            env=CHILD_ENV,
            cwd="/",
            max_output_bytes=_MAX_ANSWER_BYTES,
        )
    except CommandError as error:
        raise WriteRefused(f"cannot write {path} as {entry.pw_name}: {error}") from error
    lines = result.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if result.returncode != 0 or not isinstance(answer, dict):
        detail = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise WriteRefused(f"cannot write {path} as {entry.pw_name}: {detail[:300]}")
    if answer.get("ok") is not True:
        raise WriteRefused(f"{answer.get('error', 'refused')} (as {entry.pw_name})")


def _child_main() -> int:
    """The child's side: one JSON request on stdin, one JSON line on stdout."""
    try:
        request = json.loads(sys.stdin.read())
        if not isinstance(request, dict):
            raise WriteRefused("the request is not an object")
        _serve(request, judge=False)
    except (WriteRefused, ValueError, KeyError, TypeError) as error:
        print(json.dumps({"error": str(error)}))
        return 0
    print(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
