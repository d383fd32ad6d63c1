"""The walk that opens a user's file inside its tree, one component at a time, and the kinds of
refusal it (and any read as the owner) ends in.

Apart from the parent's API (`owner_files`) and the request it serves (`owner_serve`) because
it is the part that decides what may be opened.

Each read names a tree (a directory: a template's own directory, the job's work dir for a log
that lies in it and else the log's own directory, a checkpoint root) and a path inside it.
Paths are opened one component at a time with `openat(..., O_PATH | O_NOFOLLOW)` from the
directory above, never by a path the kernel resolves, so a component swapped for a link
halfway is seen, not followed:
- Down to the tree itself, a symlink is followed only if root owns it (the system's own layout,
  `/home -> /data/home`), or the owner does and the read is the owner's (then the rights are the
  owner's anyway).
- Inside the tree, a symlink is followed only when the read is the owner's, and only while it
  stays inside: `..` may not climb above the tree, and an absolute target must name the tree.
  Any other link, in the middle of the path or at its end, is refused.
- Only regular files are read (opened non-blocking, so a FIFO cannot hang the open), and a file
  over its cap is refused from its size before any read; at most cap + 1 bytes are ever read.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

MAX_SYMLINKS = 40  # the kernel's own limit on links in one lookup
MAX_DEPTH = 64  # directories held open by one walk (each is a descriptor)
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RefusalKind(StrEnum):
    DENIED = "denied"  # the owner may not read it
    NOT_REGULAR = "not_regular"  # a FIFO, a device, a directory, a socket
    MISSING = "missing"
    SYMLINK = "symlink"  # a link not followed: not the owner's read, or it leaves the tree
    OUTSIDE = "outside"  # the path itself names something outside the tree it is read in
    TOO_LARGE = "too_large"  # over the size cap, refused before reading
    UNUSABLE = (
        "unusable"  # exists, but not as the operation needs (a checkpoint root that is a file)
    )
    NO_OWNER = "no_owner"  # the job's owner has no known uid here
    EXPOSED = "exposed"  # another user owns it or may write it: not the owner's own input
    TIMEOUT = "timeout"
    FAILED = "failed"  # the reading child itself broke (or hit its memory limit)


class WalkRefused(Exception):
    """A read refused by the walk; `code` is the errno a file-system seam reports it as."""

    def __init__(self, kind: RefusalKind, reason: str, code: int = errno.EPERM) -> None:
        super().__init__(reason)
        self.kind = kind
        self.code = code

    def as_os_error(self) -> OSError:
        return OSError(self.code, str(self))


def read_capped(fd: int, cap: int, what: str) -> bytes:
    """The whole file, refused from its size when over `cap`; never more than cap + 1 bytes."""
    size = os.fstat(fd).st_size
    if size > cap:
        raise WalkRefused(
            RefusalKind.TOO_LARGE, f"{what} is {size} bytes, over the {cap}-byte cap", errno.EFBIG
        )
    chunks: list[bytes] = []
    total = 0
    while total <= cap:
        chunk = os.read(fd, cap + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > cap:
        raise WalkRefused(
            RefusalKind.TOO_LARGE, f"{what} grew over the {cap}-byte cap", errno.EFBIG
        )
    return b"".join(chunks)


@dataclass(frozen=True)
class Tree:
    """An opened tree: its directory (an O_PATH descriptor), how the caller named it, the path
    the walk took to it, and whether links inside it may be followed (the owner's read)."""

    fd: int
    named: tuple[str, ...]
    real: tuple[str, ...]
    follow_links: bool

    def describe(self) -> str:
        return "/" + "/".join(self.named)


Want = Literal["file", "dir", "any"]


def path_components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def path_below(parts: list[str], prefix: list[str] | tuple[str, ...]) -> list[str] | None:
    """The rest of `parts` below `prefix`, or None when `parts` does not start with it."""
    head = parts[: len(prefix)]
    if len(head) < len(prefix) or head != list(prefix) or ".." in head:
        return None
    return parts[len(prefix) :]


def open_tree(path: str, *, as_owner: bool) -> Tree:
    """Walk from `/` to the tree, following only links root owns (or the owner, as the owner)."""
    if not path.startswith("/"):
        raise WalkRefused(RefusalKind.OUTSIDE, f"{path!r} is not an absolute path")
    link_owners = frozenset({0, os.geteuid()}) if as_owner else frozenset({0})
    top = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, real = _walk(top, path_components(path), _AboveTree(path, link_owners), want="dir")
    except WalkRefused as refusal:
        if refusal.code == errno.ENOTDIR:
            raise WalkRefused(
                RefusalKind.UNUSABLE, f"{path} is not a directory", errno.ENOTDIR
            ) from refusal
        raise
    finally:
        os.close(top)
    return Tree(fd, tuple(path_components(os.path.normpath(path))), real, as_owner)


@contextmanager
def opened_tree(path: str, *, as_owner: bool) -> Iterator[Tree]:
    tree = open_tree(path, as_owner=as_owner)
    try:
        yield tree
    finally:
        os.close(tree.fd)


def open_in(tree: Tree, path: str, *, want: Want) -> tuple[int, tuple[str, ...]]:
    """Open `path` (absolute and naming the tree, or relative to it) without leaving the tree;
    returns the descriptor and the real path's components."""
    parts = path_components(path)
    if path.startswith("/"):
        rest = path_below(parts, tree.named)
        if rest is None:
            rest = path_below(parts, tree.real)
        if rest is None:
            raise WalkRefused(RefusalKind.OUTSIDE, f"{path} is not inside {tree.describe()}")
        parts = rest
    fd, below = _walk(tree.fd, parts, _InsideTree(tree, path), want=want)
    return fd, tree.real + below


class _AboveTree:
    """Links on the way to a tree: followed when a trusted uid owns them; `..` stops at `/`."""

    def __init__(self, path: str, link_owners: frozenset[int]) -> None:
        self.path = path
        self.link_owners = link_owners

    def climb_out(self, *, after_link: bool) -> None:
        return  # `/..` is `/`

    def follow(self, name: str, owner_uid: int, target: str) -> tuple[bool, list[str]]:
        if owner_uid not in self.link_owners:
            raise WalkRefused(
                RefusalKind.SYMLINK,
                f"{name!r} on the way to {self.path} is a symlink of uid {owner_uid}: only "
                "root's links, or the owner's own when read as the owner, are followed there",
                errno.EXDEV,
            )
        return target.startswith("/"), path_components(target)


class _InsideTree:
    """Links inside a tree: only in the owner's read, and only while they stay inside."""

    def __init__(self, tree: Tree, path: str) -> None:
        self.tree = tree
        self.path = path

    def climb_out(self, *, after_link: bool) -> None:
        raise WalkRefused(
            RefusalKind.SYMLINK if after_link else RefusalKind.OUTSIDE,
            f"{self.path} climbs out of {self.tree.describe()} with `..`"
            + (" (through a symlink)" if after_link else ""),
            errno.EXDEV,
        )

    def follow(self, name: str, owner_uid: int, target: str) -> tuple[bool, list[str]]:
        if not self.tree.follow_links:
            raise WalkRefused(
                RefusalKind.SYMLINK,
                f"{name!r} in {self.path} is a symlink and this read is not the owner's",
                errno.ELOOP,
            )
        parts = path_components(target)
        if not target.startswith("/"):
            return False, parts
        rest = path_below(parts, self.tree.named)
        if rest is None:
            rest = path_below(parts, self.tree.real)
        if rest is None:
            raise WalkRefused(
                RefusalKind.SYMLINK,
                f"{name!r} in {self.path} is a symlink leaving {self.tree.describe()} "
                f"(to {target[:200]})",
                errno.EXDEV,
            )
        return True, rest


def _walk(
    base: int, names: list[str], policy: _AboveTree | _InsideTree, *, want: Want
) -> tuple[int, tuple[str, ...]]:
    """Open `names` below the directory `base`, one `openat` per component, links handed to
    `policy`. Returns a descriptor (read-only for a file, O_PATH otherwise) the caller closes,
    and the components walked below `base`. `..` pops what this walk opened, never the
    kernel's idea of the parent, so a directory moved away cannot take the walk with it."""
    stack: list[tuple[str, int]] = []
    pending = deque(names)
    links = 0
    try:
        while pending:
            name = pending.popleft()
            if name == "..":
                if stack:
                    os.close(stack.pop()[1])
                else:
                    policy.climb_out(after_link=links > 0)
                continue
            parent = stack[-1][1] if stack else base
            last = not pending
            fd = _open_component(parent, name, read=last and want == "file")
            status = os.fstat(fd)
            if stat.S_ISLNK(status.st_mode):
                try:
                    target = os.readlink("", dir_fd=fd)
                finally:
                    os.close(fd)
                links += 1
                if links > MAX_SYMLINKS:
                    raise WalkRefused(
                        RefusalKind.SYMLINK,
                        f"more than {MAX_SYMLINKS} symlinks (a loop?)",
                        errno.ELOOP,
                    )
                absolute, rest = policy.follow(name, status.st_uid, target)
                if absolute:
                    while stack:
                        os.close(stack.pop()[1])
                pending.extendleft(reversed(rest))
                continue
            if last:
                _check_kind(fd, status.st_mode, name, want)
                return fd, (*(entry for entry, _ in stack), name)
            if not stat.S_ISDIR(status.st_mode):
                os.close(fd)
                raise WalkRefused(
                    RefusalKind.UNUSABLE, f"{name!r} is not a directory", errno.ENOTDIR
                )
            stack.append((name, fd))
            if len(stack) > MAX_DEPTH:
                raise WalkRefused(RefusalKind.UNUSABLE, f"deeper than {MAX_DEPTH} directories")
        if want == "file":
            raise WalkRefused(RefusalKind.NOT_REGULAR, "a directory, not a file", errno.EISDIR)
        fd = stack.pop()[1] if stack else os.dup(base)
        return fd, tuple(entry for entry, _ in stack)
    finally:
        for _, opened in stack:
            os.close(opened)


def _open_component(parent: int, name: str, *, read: bool) -> int:
    """O_PATH for directories and links (search permission is enough, as for any lookup);
    a final file is opened for reading, non-blocking, so a FIFO answers at once."""
    try:
        return os.open(name, _READ_FLAGS if read else _PATH_FLAGS, dir_fd=parent)
    except OSError as error:
        if read and error.errno == errno.ELOOP:
            return _open_component(parent, name, read=False)  # the link itself, to follow it
        raise WalkRefused(
            _ERRNO_KINDS.get(error.errno or 0, RefusalKind.FAILED),
            f"{name!r}: {error.strerror}",
            error.errno or errno.EIO,
        ) from error


_ERRNO_KINDS = {
    errno.EACCES: RefusalKind.DENIED,
    errno.EPERM: RefusalKind.DENIED,
    errno.ENOENT: RefusalKind.MISSING,
    errno.ENOTDIR: RefusalKind.UNUSABLE,
}


def _check_kind(fd: int, mode: int, name: str, want: Want) -> None:
    if want == "file" and not stat.S_ISREG(mode):
        os.close(fd)
        raise WalkRefused(RefusalKind.NOT_REGULAR, f"{name!r} is not a regular file", errno.EINVAL)
    if want == "file" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH:
        # an O_PATH descriptor cannot be read: the name was a link a moment before
        os.close(fd)
        raise WalkRefused(RefusalKind.FAILED, f"{name!r} changed while it was opened", errno.EAGAIN)
    if want == "dir" and not stat.S_ISDIR(mode):
        os.close(fd)
        raise WalkRefused(RefusalKind.UNUSABLE, f"{name!r} is not a directory", errno.ENOTDIR)


class TreeReader:
    """`checkpoints.CheckpointReader` over one opened tree: every call walks from its root."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree

    def list_dir(self, path: Path) -> list[str]:
        fd = self._open(path, "dir")
        try:
            listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            return os.listdir(listing)
        finally:
            os.close(listing)

    def kind(self, path: Path) -> str:
        try:
            fd = self._open(path, "any")
        except FileNotFoundError:
            return "missing"
        except OSError:
            return "other"
        try:
            mode = os.fstat(fd).st_mode
        finally:
            os.close(fd)
        if stat.S_ISDIR(mode):
            return "dir"
        return "file" if stat.S_ISREG(mode) else "other"

    def resolve(self, path: Path) -> Path:
        try:
            fd, real = open_in(self.tree, str(path), want="any")
        except WalkRefused as refusal:
            raise refusal.as_os_error() from refusal
        os.close(fd)
        return Path("/" + "/".join(real))

    def read_bytes(self, path: Path, limit: int) -> bytes:
        fd = self._open(path, "file")
        try:
            return read_capped(fd, limit, path.name)
        except WalkRefused as refusal:
            raise refusal.as_os_error() from refusal
        finally:
            os.close(fd)

    def _open(self, path: Path, want: Want) -> int:
        try:
            return open_in(self.tree, str(path), want=want)[0]
        except WalkRefused as refusal:
            raise refusal.as_os_error() from refusal
