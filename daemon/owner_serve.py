"""Serving one read of a user's files: in the child that has become the owner (`python -m
daemon.owner_serve`, started by `owner_files` through `setpriv`), or in this process when it
is not root. `answer` turns one request into one reply; the caps on what is read are here.

Apart from the parent's API (`owner_files`) because this is the code that runs as the owner
on the owner's bytes: the child limits itself before it reads a byte (`CHILD_MEMORY_BYTES` of
address space, CPU a little over the timeout, no file writes, few descriptors, no core), so a
hostile file can only break the child. A job log is scanned here too, on the descriptor the walk
(`owner_walk`) opened.
"""

from __future__ import annotations

import base64
import errno
import json
import math
import os
import re
import resource
import stat
import sys
import tomllib
from collections.abc import Callable
from typing import Any

from daemon.checkpoints import (
    CheckpointError,
    CheckpointLayout,
    CheckpointScan,
    CheckpointSpec,
    find_last_good,
)
from daemon.evidence.joblog import LogReadError, scan_log
from daemon.evidence.records import LogFindings
from daemon.owner_transport import refused_reply, scan_to_json
from daemon.owner_walk import (
    RefusalKind,
    Tree,
    TreeReader,
    WalkRefused,
    open_in,
    open_tree,
    opened_tree,
    read_capped,
)
from daemon.store.codec import to_json

DEFAULT_TIMEOUT_S = 60.0
MAX_TAIL_BYTES = 16 * 1024 * 1024  # what `read_tail` hands over, base64 in one JSON line
# How far back a log scan may be asked to look: the scan's time limit bounds its work whatever
# this is, and it reads in windows, never the whole span at once.
MAX_SCAN_BYTES = 1024**4
TEMPLATE_FILE = "template.toml"
MAX_TEMPLATE_FILE_BYTES = 1_000_000  # template.toml and its script: real ones are a few KB
# Config files an imported template keeps (`[configs]`: a DeepSpeed JSON, a YAML), each under
# the file cap, all of them under the total: the answer carries them as JSON text.
MAX_TEMPLATE_CONFIGS = 8
MAX_TEMPLATE_CONFIG_BYTES = 2_000_000
CHILD_MEMORY_BYTES = 1024**3
CHILD_OPEN_FILES = 256
_MAX_REQUEST_CHARS = 1024 * 1024


def answer(request: dict[str, Any], *, as_owner: bool) -> dict[str, Any]:
    """Serve one request with this process's rights: `{"ok": ...}` or `{"refused": ...}`.

    `as_owner`: this process has the owner's rights (the child, or the owner's own CLI); only
    then are links followed at all inside the tree (see `owner_walk`).
    """
    path = str(request["path"])
    tree = str(request.get("tree") or path)
    try:
        if request["op"] == "scan_log":
            findings = _scan_log(
                tree,
                path,
                min(int(request["max_bytes"]), MAX_SCAN_BYTES),
                request.get("step_pattern"),
                as_owner=as_owner,
            )
            return {"ok": to_json(findings)}
        if request["op"] == "read_tail":
            data = _read_tail(tree, path, int(request["limit"]), as_owner=as_owner)
            return {"ok": base64.b64encode(data).decode("ascii")}
        if request["op"] == "find_last_good":
            return {"ok": scan_to_json(_find_last_good(request, tree, as_owner=as_owner))}
        if request["op"] == "read_template":
            owned = request.get("owned") is True
            return {"ok": _read_template(tree, as_owner=as_owner, owned=owned)}
    except WalkRefused as refusal:
        return refused_reply(refusal.kind, str(refusal))
    except LogReadError as error:
        return refused_reply(RefusalKind.FAILED, f"log not scanned: {error}")
    except (ValueError, ArithmeticError, LookupError, re.error) as error:
        # a bad request, or a parser tripped by what the file holds: a refusal either way
        return refused_reply(RefusalKind.FAILED, f"not read: {type(error).__name__}: {error}")
    except CheckpointError as error:
        return refused_reply(RefusalKind.UNUSABLE, str(error))
    except OSError as error:
        return refused_reply(RefusalKind.FAILED, f"{path}: {error.strerror or error}")
    except (MemoryError, RecursionError) as error:
        return refused_reply(
            RefusalKind.FAILED, f"the reader ran out of room: {type(error).__name__}"
        )
    return refused_reply(RefusalKind.FAILED, f"unknown operation {request['op']!r}")


def _scan_log(
    tree: str, path: str, max_bytes: int, step_pattern: str | None, *, as_owner: bool
) -> LogFindings:
    """The scanner on the log's descriptor, opened by the walk: what the kernel let the owner
    open is what is read, and nothing is copied out of the file before the scanner reads it."""
    with opened_tree(tree, as_owner=as_owner) as root:
        fd, _ = open_in(root, path, want="file")
    try:
        return scan_log(fd, step_pattern=step_pattern, byte_budget=max_bytes)
    finally:
        os.close(fd)


def _read_tail(tree: str, path: str, limit: int, *, as_owner: bool) -> bytes:
    with opened_tree(tree, as_owner=as_owner) as root:
        fd, _ = open_in(root, path, want="file")
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - min(limit, MAX_TAIL_BYTES))
        return os.pread(fd, size - start, start)
    finally:
        os.close(fd)


def _find_last_good(request: dict[str, Any], tree: str, *, as_owner: bool) -> CheckpointScan:
    spec = CheckpointSpec(
        layout=CheckpointLayout(request["layout"]),
        root=str(request["path"]),
        glob=str(request.get("glob", "")),
        marker=str(request.get("marker", "")),
    )
    try:
        opened = open_tree(tree, as_owner=as_owner)
    except WalkRefused as refusal:
        if refusal.kind is RefusalKind.MISSING:
            return CheckpointScan(spec.root, None, (), "the checkpoint root does not exist yet")
        raise
    try:
        return find_last_good(spec, TreeReader(opened))
    finally:
        os.close(opened.fd)


def _read_template(directory: str, *, as_owner: bool, owned: bool) -> dict[str, Any]:
    """Every file in one walk of the template's tree; the script's name (and the kept configs')
    comes from the TOML, so the TOML is parsed here too, by the owner's child. `owned`: each
    one must be held by the reader (`held_by_reader`), for a template about to run."""
    check = held_by_reader if owned else _unchecked
    with opened_tree(directory, as_owner=as_owner) as root:
        check(root.fd, directory)
        toml_path = f"{directory.rstrip('/')}/{TEMPLATE_FILE}"
        toml_text = _decode(_read_file(root, TEMPLATE_FILE, "template.toml", check), toml_path)
        try:
            document = tomllib.loads(toml_text)
        except (tomllib.TOMLDecodeError, RecursionError) as error:
            raise WalkRefused(RefusalKind.UNUSABLE, f"cannot read {toml_path}: {error}") from error
        script = document.get("script")
        if not isinstance(script, str) or not script:
            raise WalkRefused(
                RefusalKind.UNUSABLE, "template.toml needs a non-empty string `script`"
            )
        if script.startswith("/") or ".." in script.split("/"):
            raise WalkRefused(
                RefusalKind.OUTSIDE, f"script {script!r} must be a file inside {directory}"
            )
        script_path = f"{directory.rstrip('/')}/{script}"
        raw = _read_file(root, script, "script", check)
        if b"\0" in raw:
            raise WalkRefused(RefusalKind.UNUSABLE, f"{script_path} is not a script (binary)")
        if document.get("imported") is True:  # the user's own script, kept byte for byte
            return {
                "toml": toml_text,
                "script": raw.decode("utf-8", "surrogateescape"),
                "configs": _read_configs(root, directory, document.get("configs", {}), check),
            }
        return {"toml": toml_text, "script": _decode(raw, script_path)}


def _read_configs(
    root: Tree, directory: str, table: object, check: Callable[[int, str], None]
) -> dict[str, str]:
    """The config files an imported template keeps (`[configs]`: path -> file), read as its
    script is: inside the directory, capped, text only, bytes that are not UTF-8 kept."""
    if not isinstance(table, dict):
        raise WalkRefused(RefusalKind.UNUSABLE, "template.toml: [configs] must be a table")
    if len(table) > MAX_TEMPLATE_CONFIGS:
        raise WalkRefused(
            RefusalKind.UNUSABLE, f"[configs] names more than {MAX_TEMPLATE_CONFIGS} files"
        )
    texts: dict[str, str] = {}
    total = 0
    for name in table.values():
        if not isinstance(name, str) or not name:
            raise WalkRefused(RefusalKind.UNUSABLE, "[configs] values must be non-empty strings")
        if name.startswith("/") or ".." in name.split("/"):
            raise WalkRefused(
                RefusalKind.OUTSIDE, f"config {name!r} must be a file inside {directory}"
            )
        raw = _read_file(root, name, "config", check)
        total += len(raw)
        if total > MAX_TEMPLATE_CONFIG_BYTES:
            raise WalkRefused(
                RefusalKind.TOO_LARGE,
                f"the configs are over {MAX_TEMPLATE_CONFIG_BYTES} bytes together",
                errno.EFBIG,
            )
        if b"\0" in raw:
            raise WalkRefused(RefusalKind.UNUSABLE, f"{directory.rstrip('/')}/{name} is binary")
        texts[name] = raw.decode("utf-8", "surrogateescape")
    return texts


def held_by_reader(fd: int, path: str) -> None:
    """A template's directory and files are its owner's own input, or root's: owned by the
    reader (the owner, in the child) or by root, and writable by neither group nor others.
    Otherwise someone else could change what a relaunch runs as the owner between two reads,
    so it is refused with the reason."""
    status = os.fstat(fd)
    if status.st_uid not in (0, os.geteuid()):
        raise WalkRefused(
            RefusalKind.EXPOSED,
            f"{path} belongs to uid {status.st_uid}, not to the template's owner (or root)",
        )
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise WalkRefused(
            RefusalKind.EXPOSED,
            f"{path} may be written by others (mode {stat.S_IMODE(status.st_mode):04o})",
        )


def _unchecked(fd: int, path: str) -> None:
    """A read to show or check a template: whose files they are is not asked."""


def _read_file(root: Tree, name: str, what: str, check: Callable[[int, str], None]) -> bytes:
    fd, _ = open_in(root, name, want="file")
    try:
        check(fd, f"{root.describe().rstrip('/')}/{name}")
        return read_capped(fd, MAX_TEMPLATE_FILE_BYTES, f"the {what} {name!r}")
    finally:
        os.close(fd)


def _decode(raw: bytes, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise WalkRefused(RefusalKind.UNUSABLE, f"{path} is not UTF-8: {error}") from error


def limit_self(cpu_seconds: int) -> None:
    """Before any of the owner's bytes: whatever they hold can only exhaust this child."""
    limits = {
        resource.RLIMIT_AS: CHILD_MEMORY_BYTES,
        resource.RLIMIT_CPU: cpu_seconds,
        resource.RLIMIT_FSIZE: 0,
        resource.RLIMIT_NOFILE: CHILD_OPEN_FILES,
        resource.RLIMIT_CORE: 0,
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def _child_main(argv: list[str]) -> int:
    """The child's whole life: it already runs as the owner, so its reads are the owner's."""
    limit_self(int(argv[1]) if len(argv) > 1 else math.ceil(DEFAULT_TIMEOUT_S) + 5)
    try:
        request = json.loads(sys.stdin.read(_MAX_REQUEST_CHARS))
        if not isinstance(request, dict) or "path" not in request or "op" not in request:
            raise ValueError("the request must be an object with op and path")
        reply = answer(request, as_owner=True)
    except (ValueError, KeyError, TypeError) as error:
        reply = refused_reply(RefusalKind.FAILED, f"bad request: {error}")
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv))
