"""What crosses between the daemon and its reading child: a refusal as the child answers it, and
a checkpoint scan as JSON both ways.

Apart from both sides (`owner_files`, the parent; `owner_serve`, the child) so that each writes
and reads the same shape: the child prints one JSON line, `{"ok": ...}` or
`{"refused": {"kind": ..., "reason": ...}}`, and the parent trusts nothing in it it has not
checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.checkpoints import Checkpoint, CheckpointLayout, CheckpointScan, Skipped
from daemon.owner_walk import RefusalKind


def refused_reply(kind: RefusalKind, reason: str) -> dict[str, Any]:
    return {"refused": {"kind": kind.value, "reason": reason}}


def scan_to_json(scan: CheckpointScan) -> dict[str, Any]:
    found = scan.found
    return {
        "root": scan.root,
        "reason": scan.reason,
        "skipped": [{"name": item.name, "reason": item.reason} for item in scan.skipped],
        "found": None
        if found is None
        else {
            "layout": found.layout.value,
            "path": str(found.path),
            "step": found.step,
            "resume_path": found.resume_path,
            "tag": found.tag,
        },
    }


def scan_from_json(data: Any) -> CheckpointScan:
    found = data["found"]
    return CheckpointScan(
        root=str(data["root"]),
        found=None
        if found is None
        else Checkpoint(
            layout=CheckpointLayout(found["layout"]),
            path=Path(found["path"]),
            step=None if found["step"] is None else int(found["step"]),
            resume_path=str(found["resume_path"]),
            tag=None if found["tag"] is None else str(found["tag"]),
        ),
        skipped=tuple(Skipped(str(item["name"]), str(item["reason"])) for item in data["skipped"]),
        reason=str(data["reason"]),
    )
