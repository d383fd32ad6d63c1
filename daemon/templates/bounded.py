"""A template loaded for the daemon in a child with a deadline and a memory cap.

A template is the user's text, and loading one runs the importer's readers over the user's
script and configs. However linear those are meant to be, the root daemon does not bet its
cycle on it: the child (`python -m daemon.templates.bounded`, the owner's process when the
daemon is root) reads the directory with the owner's rights and loads the whole template under
its own limits. Only a template that loaded there within them comes back, as the texts the
owner's read returned; the daemon then builds it from those texts, work the child has just
shown to fit. A template that does not load in time, or in the memory, is a `TemplateError`
("template refused: ..."), which the pipeline records on the incident like any other broken
template, and the cycle moves on.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from daemon.owner_files import CHILD_ENV, Owner, OwnerFiles, OwnerReadRefused, TemplateTexts
from daemon.owner_serve import (
    CHILD_MEMORY_BYTES,
    MAX_TEMPLATE_CONFIG_BYTES,
    MAX_TEMPLATE_FILE_BYTES,
    limit_self,
)
from daemon.process import CommandError, CommandTimeout, as_user_argv, run
from daemon.templates.model import TemplateError
from daemon.templates.reading import template_from_texts

_CHILD_MODULE = "daemon.templates.bounded"
# A real template loads in a few tens of milliseconds after the interpreter's start; the
# importer's worst inputs in well under a second (make bench BENCH=hostile).
LOAD_TIMEOUT_S = 10.0
# Address space, not resident memory: the interpreter and the template's imports take about
# 300 MB of it before the template is read.
LOAD_MEMORY_BYTES = CHILD_MEMORY_BYTES
# The texts come back as JSON: the template's file cap twice (toml, script) and its configs',
# escaped at worst six bytes a character.
_MAX_ANSWER_BYTES = 6 * (2 * MAX_TEMPLATE_FILE_BYTES + MAX_TEMPLATE_CONFIG_BYTES) + 4096


def read_template_bounded(
    owner: Owner, directory: str, *, drop_privileges: bool, timeout_s: float | None = None
) -> TemplateTexts:
    """The template's texts as `owner` reads them, once the whole template has loaded from
    them in a child within `timeout_s` (default `LOAD_TIMEOUT_S`) and `LOAD_MEMORY_BYTES`;
    `TemplateError` otherwise.

    `drop_privileges`: the child becomes the owner (the daemon as root); without it the child
    reads with this process's rights (the owner's own CLI, or a daemon that is not root)."""
    timeout_s = LOAD_TIMEOUT_S if timeout_s is None else timeout_s
    argv = [sys.executable, "-I", "-B", "-m", _CHILD_MODULE, str(math.ceil(timeout_s) + 1)]
    if drop_privileges:
        argv = as_user_argv(owner.uid, owner.gid, argv)
    try:
        result = run(
            argv,
            timeout=timeout_s,
            input_text=json.dumps({"directory": directory}),
            env=CHILD_ENV,
            cwd="/",
            max_output_bytes=_MAX_ANSWER_BYTES,
        )
    except CommandTimeout as error:
        raise TemplateError(
            f"template refused: {directory} did not load within {timeout_s:g}s"
        ) from error
    except CommandError as error:
        raise TemplateError(f"template refused: {directory}: {error}") from error
    lines = result.stdout.strip().splitlines()
    reply: Any = None
    if result.returncode == 0 and lines:
        try:
            reply = json.loads(lines[-1])
        except json.JSONDecodeError:
            reply = None
    if not isinstance(reply, dict):
        detail = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise TemplateError(
            f"template refused: {directory} did not load within its limits "
            f"({LOAD_MEMORY_BYTES // 1024**2} MiB, {timeout_s:g}s): {detail[:300]}"
        )
    if "error" in reply:
        raise TemplateError(str(reply["error"]))
    return _texts(reply.get("ok"), directory)


def _texts(value: object, directory: str) -> TemplateTexts:
    if not isinstance(value, dict):
        raise TemplateError(f"template refused: {directory}: the loader gave no texts")
    toml_text, script_text, configs = value.get("toml"), value.get("script"), value.get("configs")
    if (
        not isinstance(toml_text, str)
        or not isinstance(script_text, str)
        or not isinstance(configs, dict)
        or not all(isinstance(text, str) for text in configs.values())
    ):
        raise TemplateError(f"template refused: {directory}: the loader's texts are malformed")
    kept = tuple((str(name), str(text)) for name, text in configs.items())
    return TemplateTexts(directory, toml_text, script_text, kept)


def _load_here(directory: str) -> dict[str, Any]:
    """The child's work: read as this process (the owner), then load the whole template."""
    try:
        texts = OwnerFiles.as_caller().read_template(directory, owned=True)
    except OwnerReadRefused as error:
        refusal = error.refusal
        return {
            "error": f"template {directory} not read as {refusal.owner}: "
            f"{refusal.kind}: {refusal.reason}"
        }
    try:
        template_from_texts(texts, Path(directory))
    except TemplateError as error:
        return {"error": str(error)}
    except (MemoryError, RecursionError) as error:
        return {"error": f"template refused: {directory}: {type(error).__name__} while loading"}
    return {
        "ok": {
            "toml": texts.toml_text,
            "script": texts.script_text,
            "configs": dict(texts.configs),
        }
    }


def _child_main(argv: list[str]) -> int:
    cpu_seconds = int(argv[1]) if len(argv) > 1 else math.ceil(LOAD_TIMEOUT_S) + 1
    limit_self(cpu_seconds)  # the owner reader's limits, before a byte of the template
    try:
        request = json.loads(sys.stdin.read(64 * 1024))
        directory = request["directory"]
        if not isinstance(directory, str):
            raise TypeError("directory must be a string")
    except (ValueError, KeyError, TypeError) as error:
        reply: dict[str, Any] = {"error": f"template refused: bad request: {error}"}
    else:
        reply = _load_here(directory)
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv))
