"""Read what a user wrote (logs, checkpoints, receipts, templates) as that user, never as root.

The daemon runs as root so that it can submit as owners and drain nodes; root may read every
file, and a job's output directory or a template directory is the owner's to fill with
anything, a symlink to `/etc/shadow` or `/dev/zero` or a FIFO included. So every such read
happens in a short-lived child that has become the owner (`setpriv --reuid --regid
--init-groups`, through the one subprocess seam) before it opens anything: the kernel, not our
checks, says what the owner may read. The child limits itself before it reads a byte (1 GiB of
address space, CPU a little over the timeout, no file writes, few descriptors, no core), so a
hostile file can only break the child: the caller gets a refusal of kind `failed` or `timeout`.
The child answers one JSON request with one JSON line. A job log is scanned in the child too,
as `slurm-medic diagnose --log` scans it: the child opens the log through the walk and runs the
job-log scanner on its descriptor, from the end back as far as the scan needs (the root failure
behind a cascade of thousands of ranks) and at most `max_bytes`, within the scanner's time limit.
The scanner reads with `pread` in windows of a few MiB and keeps only what its analysis needs,
so the 1 GiB address-space limit holds whatever the log's size (a memory map of a huge log
would count against it, and a log cut short under it would kill the child with SIGBUS). The
daemon never holds more than the findings.

Not running as root, the same walk runs in this process with its own rights.

The pieces: this module is the parent's side (`OwnerFiles`, the records a refusal leaves);
`owner_serve` serves a request (in the child, or here when not root); `owner_walk` opens a
path inside its tree, link by link; `owner_transport` is what crosses between them as JSON.

Whatever the cause (no permission, a link that leaves the tree, a FIFO, a directory, a size
over the cap, a timeout, an owner without a uid), the caller gets `OwnerReadRefused` with a
typed `Refusal` to put on the record, never the content.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pwd
import sys
from dataclasses import dataclass
from typing import Any

from daemon.checkpoints import (
    CheckpointScan,
    CheckpointSpec,
)
from daemon.evidence.joblog import DEFAULT_BYTE_BUDGET
from daemon.evidence.records import LogFindings
from daemon.owner_serve import DEFAULT_TIMEOUT_S, MAX_SCAN_BYTES, MAX_TAIL_BYTES, answer
from daemon.owner_transport import scan_from_json
from daemon.owner_walk import (
    RefusalKind,
    path_below,
    path_components,
)
from daemon.process import CommandError, CommandTimeout, as_user_argv, run
from daemon.store.codec import CodecError, from_json

_CHILD_MODULE = "daemon.owner_serve"
# The largest honest answer is a read_tail's MAX_TAIL_BYTES in base64 (4/3) inside JSON; the
# child runs as the owner, who could make it print anything, so more than that is refused.
_MAX_ANSWER_BYTES = 2 * MAX_TAIL_BYTES
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class Refusal:
    """Why a user's file was not read, in words for the record."""

    kind: RefusalKind
    path: str
    owner: str
    reason: str


class OwnerReadRefused(Exception):
    """A read as the owner that gave no content; `refusal` belongs on the record."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(
            f"{refusal.path!r} not read as {refusal.owner}: {refusal.kind}: {refusal.reason}"
        )
        self.refusal = refusal


@dataclass(frozen=True)
class Owner:
    """Whose rights a read uses: the uid and primary gid, and the name for messages."""

    name: str
    uid: int
    gid: int

    @classmethod
    def from_uid(cls, uid: int) -> Owner:
        """The owner as the password database knows it; `--init-groups` needs the entry."""
        try:
            entry = pwd.getpwuid(uid)
        except KeyError as error:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", str(uid), f"uid {uid} has no passwd entry")
            ) from error
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid)

    @classmethod
    def from_name(cls, name: str) -> Owner:
        """A lineage's owner, recorded by name."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError as error:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", name, f"user {name!r} has no passwd entry")
            ) from error
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid)

    @classmethod
    def for_job(cls, *, user: str, uid: int | None) -> Owner:
        """The owner of a job record; without a uid nothing is read (never as root instead)."""
        if uid is None:
            raise OwnerReadRefused(
                Refusal(RefusalKind.NO_OWNER, "", user, "the job record has no uid")
            )
        return cls.from_uid(uid)

    @classmethod
    def current(cls) -> Owner:
        """This process's own identity: a CLI reads the caller's files as the caller."""
        uid = os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return cls(name=name, uid=uid, gid=os.getegid())


@dataclass(frozen=True)
class TemplateTexts:
    """A template directory as its owner could read it: `template.toml`, its script, and the
    config files an imported template keeps (file in the directory -> text)."""

    directory: str
    toml_text: str
    script_text: str
    configs: tuple[tuple[str, str], ...] = ()


def job_tree(path: str, work_dir: str | None) -> str:
    """The tree a job's file is read in: the job's work dir when the path lies in it, else the
    file's own directory (a log written elsewhere with `--output`)."""
    if work_dir and path_below(path_components(path), path_components(work_dir)) is not None:
        return work_dir
    return os.path.dirname(path) or "/"


class OwnerFiles:
    """Reads one owner's files: as that owner in a child when root, else in this process."""

    def __init__(
        self,
        owner: Owner,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        drop_privileges: bool | None = None,
    ) -> None:
        self.owner = owner
        self.timeout_s = timeout_s
        if drop_privileges is None:
            drop_privileges = os.geteuid() == 0 and owner.uid != 0
        self.drop_privileges = drop_privileges

    @classmethod
    def as_caller(cls) -> OwnerFiles:
        """The calling process reading its own files, with the same walk and caps."""
        return cls(Owner.current(), drop_privileges=False)

    def scan_log(
        self,
        path: str,
        *,
        max_bytes: int = DEFAULT_BYTE_BUDGET,
        step_pattern: str | None = None,
        tree: str | None = None,
    ) -> LogFindings:
        """The job-log scanner's findings, scanned by the reader from the log's end back at most
        `max_bytes` (the scanner's byte budget): the CLI's scan, with the owner's rights."""
        if not 0 < max_bytes <= MAX_SCAN_BYTES:
            raise ValueError(f"max_bytes must be in 1..{MAX_SCAN_BYTES}, got {max_bytes}")
        request = {
            "op": "scan_log",
            "path": path,
            "tree": tree or job_tree(path, None),
            "max_bytes": max_bytes,
            "step_pattern": step_pattern,
        }
        answer = self._ask(request)
        try:
            return from_json(LogFindings, answer)
        except CodecError as error:
            raise self._failed(path, f"unreadable findings from the reader: {error}") from error

    def read_tail(self, path: str, limit: int, *, tree: str | None = None) -> bytes:
        """The last `limit` bytes of a regular file (at most `MAX_TAIL_BYTES`)."""
        request = {
            "op": "read_tail",
            "path": path,
            "tree": tree or job_tree(path, None),
            "limit": _checked_limit(limit),
        }
        answer = self._ask(request)
        if not isinstance(answer, str):
            raise self._failed(path, "the reader did not return bytes")
        return base64.b64decode(answer)

    def find_last_good(self, spec: CheckpointSpec) -> CheckpointScan:
        """`checkpoints.find_last_good` run whole as the owner (one child, not one per file),
        in the tree of the checkpoint root."""
        request = {
            "op": "find_last_good",
            "path": spec.root,
            "tree": spec.root,
            "layout": spec.layout.value,
            "glob": spec.glob,
            "marker": spec.marker,
        }
        try:
            return scan_from_json(self._ask(request))
        except (KeyError, TypeError, ValueError) as error:
            raise self._failed(spec.root, f"unreadable scan from the reader: {error}") from error

    def read_template(self, directory: str, *, owned: bool = False) -> TemplateTexts:
        """`template.toml`, the script and the config files it names, all read in the
        template's directory.

        `owned`: the template is about to run as its owner (a submission, a relaunch), so the
        directory and each file must be the reader's own or root's and writable by no one else
        (`owner_serve.held_by_reader`); a read only to show or check a template needs not."""
        request = {"op": "read_template", "path": directory, "tree": directory, "owned": owned}
        answer = self._ask(request)
        texts = [answer.get(key) if isinstance(answer, dict) else None for key in _TEXT_KEYS]
        configs = answer.get("configs", {}) if isinstance(answer, dict) else None
        if not all(isinstance(text, str) for text in texts) or not isinstance(configs, dict):
            raise self._failed(directory, "the reader did not return the template's texts")
        if not all(isinstance(text, str) for text in configs.values()):
            raise self._failed(directory, "the reader did not return the configs' texts")
        toml_text, script_text = (str(text) for text in texts)
        kept = tuple((str(name), str(text)) for name, text in configs.items())
        return TemplateTexts(directory, toml_text, script_text, kept)

    def _ask(self, request: dict[str, Any]) -> Any:
        if not self.drop_privileges:
            as_owner = os.geteuid() == self.owner.uid
            return _unwrap(answer(request, as_owner=as_owner), request, self.owner)
        cpu_seconds = math.ceil(self.timeout_s) + 5
        argv = as_user_argv(
            self.owner.uid,
            self.owner.gid,
            [sys.executable, "-I", "-B", "-m", _CHILD_MODULE, str(cpu_seconds)],
        )
        path = str(request["path"])
        try:
            result = run(
                argv,
                timeout=self.timeout_s,
                input_text=json.dumps(request),
                env=CHILD_ENV,
                cwd="/",
                max_output_bytes=_MAX_ANSWER_BYTES,
            )
        except CommandTimeout as error:
            raise self._refusal(
                RefusalKind.TIMEOUT, path, f"no answer in {self.timeout_s:g}s"
            ) from error
        except CommandError as error:
            raise self._failed(path, str(error)) from error
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            detail = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
            raise self._failed(path, f"the reading child failed: {detail[0][:500]}")
        try:
            reply = json.loads(lines[-1])
        except json.JSONDecodeError as error:
            raise self._failed(path, f"the reading child's answer is not JSON: {error}") from error
        return _unwrap(reply, request, self.owner)

    def _refusal(self, kind: RefusalKind, path: str, reason: str) -> OwnerReadRefused:
        return OwnerReadRefused(Refusal(kind, path, self.owner.name, reason))

    def _failed(self, path: str, reason: str) -> OwnerReadRefused:
        return self._refusal(RefusalKind.FAILED, path, reason)


_TEXT_KEYS = ("toml", "script")


def _checked_limit(limit: int) -> int:
    if not 0 < limit <= MAX_TAIL_BYTES:
        raise ValueError(f"limit must be in 1..{MAX_TAIL_BYTES}, got {limit}")
    return limit


def _unwrap(reply: object, request: dict[str, Any], owner: Owner) -> Any:
    path = str(request["path"])
    if not isinstance(reply, dict) or not ({"ok"} <= reply.keys() or {"refused"} <= reply.keys()):
        raise OwnerReadRefused(
            Refusal(RefusalKind.FAILED, path, owner.name, "malformed answer from the reader")
        )
    if "ok" in reply:
        return reply["ok"]
    refused = reply["refused"]
    try:
        kind = RefusalKind(refused["kind"])
        reason = str(refused["reason"])
    except (KeyError, TypeError, ValueError):
        kind, reason = RefusalKind.FAILED, "malformed refusal from the reader"
    raise OwnerReadRefused(Refusal(kind, path, owner.name, reason))
