"""Typed patches and the revisions they make.

A patch is a typed change of knobs, never a text edit. Applying one to a revision gives a new
revision that names its parent and carries its rendered script and the unified diff. Revisions
are plain values; `RevisionDir` keeps them as JSON files under the template's `revisions/`
(the daemon's database is the other home of the same values). The directory is often a user's
and the CLI may run as root: a revision is written through `templates.safe_files` (a fresh
exclusive name renamed into place, as the user who could steer the path) and read back
without following a link, regular files only, size-capped.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from daemon.checkpoints import Checkpoint
from daemon.dialects.base import Dialect, KnobError, Knobs, KnobValue, Role
from daemon.templates.model import (
    EVERY_KNOB_MANAGED,
    LaunchTemplate,
    TemplateError,
    invariant_known,
    validate_knobs,
)
from daemon.templates.rendering import render
from daemon.templates.safe_files import WriteRefused, make_dirs, write_file

REVISIONS_DIR = "revisions"
# A revision holds one rendered script and its diff: kilobytes, a few MiB for the largest.
MAX_REVISION_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class KnobChange:
    """One knob's move; `before` guards against applying a patch to a config it was not made for."""

    knob: str
    before: KnobValue
    after: KnobValue


@dataclass(frozen=True)
class Patch:
    """A typed change of knobs, with the reason that goes into the revision's record."""

    changes: tuple[KnobChange, ...]
    reason: str

    def apply(
        self, dialect: Dialect, knobs: Knobs, not_managed: Mapping[str, str] = EVERY_KNOB_MANAGED
    ) -> dict[str, KnobValue]:
        """The knobs after this patch, validated, invariant checked where its terms are
        managed; refuses a no-op and any change of a knob that is not managed."""
        result = dict(knobs)
        for change in self.changes:
            if change.knob not in result:
                raise TemplateError(f"patch names unknown knob {change.knob!r}")
            if change.knob in not_managed:
                raise TemplateError(
                    f"{change.knob} is not managed in this template: {not_managed[change.knob]}"
                )
            if result[change.knob] != change.before:
                raise TemplateError(
                    f"patch expects {change.knob}={change.before!r} but the revision has "
                    f"{result[change.knob]!r}"
                )
            result[change.knob] = change.after
        if result == dict(knobs):
            raise TemplateError("patch changes nothing: refusing to relaunch the same config")
        try:
            return validate_knobs(dialect, result, invariant=invariant_known(dialect, not_managed))
        except KnobError as error:
            raise TemplateError(f"patch breaks the template: {error}") from error

    def describe(self) -> str:
        return ", ".join(
            f"{change.knob}: {_show(change.before)} -> {_show(change.after)}"
            for change in self.changes
        )


def _show(value: KnobValue) -> str:
    if isinstance(value, tuple):
        if value and isinstance(value[0], tuple):
            return "{" + ", ".join(f"{pair[0]}={pair[1]}" for pair in value) + "}"
        return "[" + ", ".join(str(item) for item in value) + "]"
    return repr(value)


@dataclass(frozen=True)
class TemplateRevision:
    """One rendered, immutable state of a template; `parent` is None for the first one."""

    id: str
    template: str
    parent: str | None
    knobs: Mapping[str, KnobValue]
    script: str
    diff: str
    patch: Patch | None


def _revision_id(parent: str | None, knobs: Knobs, script: str) -> str:
    payload = json.dumps(
        {"parent": parent, "knobs": knobs_to_json(knobs), "script": script}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def initial_revision(template: LaunchTemplate) -> TemplateRevision:
    script = render(template)
    return TemplateRevision(
        id=_revision_id(None, template.knobs, script),
        template=template.name,
        parent=None,
        knobs=dict(template.knobs),
        script=script,
        diff="",
        patch=None,
    )


def apply_patch(
    template: LaunchTemplate, parent: TemplateRevision, patch: Patch
) -> TemplateRevision:
    """A new revision: the parent's knobs moved by the patch, rendered, diffed with the parent."""
    knobs = patch.apply(template.dialect, parent.knobs, template.not_managed)
    script = render(template, knobs)
    if script == parent.script:
        raise TemplateError(
            f"patch ({patch.describe()}) does not change the rendered script: "
            "the lever would never reach the job"
        )
    revision_id = _revision_id(parent.id, knobs, script)
    diff = "".join(
        difflib.unified_diff(
            parent.script.splitlines(keepends=True),
            script.splitlines(keepends=True),
            fromfile=f"{template.name}@{parent.id}",
            tofile=f"{template.name}@{revision_id}",
        )
    )
    return TemplateRevision(revision_id, template.name, parent.id, knobs, script, diff, patch)


def resume_patch(template: LaunchTemplate, knobs: Knobs, checkpoint: Checkpoint) -> Patch:
    """The patch that makes a revision resume from `checkpoint`, written the dialect's way."""
    dialect = template.dialect
    resume_knob = dialect.roles[Role.RESUME]
    if resume_knob in template.not_managed:
        raise TemplateError(
            f"cannot resume from {checkpoint.path}: {resume_knob} is not managed in this "
            f"template: {template.not_managed[resume_knob]}"
        )
    changes = [KnobChange(resume_knob, knobs[resume_knob], checkpoint.resume_path)]
    tag_knob = dialect.knob_for(Role.RESUME_TAG)
    if tag_knob is not None:
        changes.append(KnobChange(tag_knob, knobs[tag_knob], checkpoint.tag or ""))
    return Patch(
        tuple(change for change in changes if change.before != change.after),
        f"resume from {checkpoint.path} (step {checkpoint.step})",
    )


def diff_revisions(first: TemplateRevision, second: TemplateRevision) -> str:
    return "".join(
        difflib.unified_diff(
            first.script.splitlines(keepends=True),
            second.script.splitlines(keepends=True),
            fromfile=f"{first.template}@{first.id}",
            tofile=f"{second.template}@{second.id}",
        )
    )


def knobs_to_json(knobs: Knobs) -> dict[str, object]:
    """Knobs as JSON-able values: env maps as objects, lists as arrays."""
    result: dict[str, object] = {}
    for name, value in knobs.items():
        if isinstance(value, tuple) and value and isinstance(value[0], tuple):
            result[name] = {str(pair[0]): str(pair[1]) for pair in value if isinstance(pair, tuple)}
        elif isinstance(value, tuple):
            result[name] = list(value)
        else:
            result[name] = value
    return result


def knobs_from_json(dialect: Dialect, data: Mapping[str, object]) -> dict[str, KnobValue]:
    """Stored knobs read back: types and ranges checked again. The invariant was checked
    where it could be when the revision was made (an imported template may not know all its
    terms, whose placeholders need not satisfy it)."""
    return validate_knobs(dialect, data, invariant=False)


def revision_to_json(revision: TemplateRevision) -> dict[str, object]:
    patch = None
    if revision.patch is not None:
        patch = {
            "reason": revision.patch.reason,
            "changes": [
                {
                    "knob": change.knob,
                    **knobs_to_json({"before": change.before, "after": change.after}),
                }
                for change in revision.patch.changes
            ],
        }
    return {
        "id": revision.id,
        "template": revision.template,
        "parent": revision.parent,
        "knobs": knobs_to_json(revision.knobs),
        "script": revision.script,
        "diff": revision.diff,
        "patch": patch,
    }


def revision_from_json(dialect: Dialect, data: Mapping[str, object]) -> TemplateRevision:
    """Read a stored revision back, re-validating every knob; raises TemplateError when damaged."""
    try:
        knobs_data = data["knobs"]
        if not isinstance(knobs_data, Mapping):
            raise TemplateError("knobs is not an object")
        knobs = knobs_from_json(dialect, knobs_data)
        patch = None
        patch_data = data.get("patch")
        if isinstance(patch_data, Mapping):
            changes = []
            for item in patch_data["changes"]:
                spec = dialect.spec(item["knob"])
                changes.append(
                    KnobChange(
                        item["knob"], spec.validate(item["before"]), spec.validate(item["after"])
                    )
                )
            patch = Patch(tuple(changes), str(patch_data["reason"]))
        fields = [data["id"], data["template"], data["script"], data["diff"]]
        if not all(isinstance(value, str) for value in fields):
            raise TemplateError("id, template, script and diff must be strings")
        parent = data.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise TemplateError("parent must be a string or null")
        return TemplateRevision(
            id=str(data["id"]),
            template=str(data["template"]),
            parent=parent,
            knobs=knobs,
            script=str(data["script"]),
            diff=str(data["diff"]),
            patch=patch,
        )
    except (KeyError, TypeError, KnobError) as error:
        raise TemplateError(f"damaged revision record: {error!r}") from error


class RevisionDir:
    """Revisions kept as `<template>/revisions/<id>.json`: the CLI's simple on-disk home."""

    def __init__(self, template: LaunchTemplate) -> None:
        if template.directory is None:
            raise TemplateError("an in-memory template has no revisions directory")
        self._template = template
        self.path = template.directory / REVISIONS_DIR

    def save(self, revision: TemplateRevision) -> Path:
        """Write the revision's file (`safe_files`: never through a link a user planted at
        any name, and as the user when the directory is theirs); TemplateError if refused."""
        target = self.path / f"{revision.id}.json"
        text = json.dumps(revision_to_json(revision), indent=2) + "\n"
        try:
            make_dirs(self.path)
            write_file(target, text.encode())
        except WriteRefused as error:
            raise TemplateError(f"revision {revision.id} not saved: {error}") from error
        return target

    def load(self, revision_id: str) -> TemplateRevision:
        if not re.fullmatch(r"[0-9a-f]{4,64}", revision_id):
            raise TemplateError(f"{revision_id!r} is not a revision id")
        matches = sorted(self.path.glob(f"{revision_id}*.json")) if self.path.is_dir() else []
        if len(matches) != 1:
            found = "no" if not matches else "several"
            raise TemplateError(f"{found} revision(s) match {revision_id!r} in {self.path}")
        try:
            data = json.loads(_read_regular(matches[0], MAX_REVISION_BYTES).decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TemplateError(f"cannot read {matches[0]}: {error}") from error
        except (RecursionError, ValueError):  # nested too deeply, a number too long
            raise TemplateError(f"cannot read {matches[0]}: not a revision record") from None
        if not isinstance(data, dict):
            raise TemplateError(f"cannot read {matches[0]}: not a revision record")
        return revision_from_json(self._template.dialect, data)

    def all(self) -> list[TemplateRevision]:
        if not self.path.is_dir():
            return []
        return [self.load(path.stem) for path in sorted(self.path.glob("*.json"))]

    def head(self) -> TemplateRevision:
        """The newest revision: the one no other revision names as parent (the first if none)."""
        revisions = self.all()
        if not revisions:
            first = initial_revision(self._template)
            self.save(first)
            return first
        parents = {revision.parent for revision in revisions}
        leaves = [revision for revision in revisions if revision.id not in parents]
        if len(leaves) != 1:
            raise TemplateError(f"revisions in {self.path} branch: {[r.id for r in leaves]}")
        return leaves[0]


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, opened without following a link or blocking (a FIFO, a device
    or a link planted in a user's directory is refused), refused over `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path.name} is larger than {limit} bytes")
    return data
