"""Paths as a person types them: `templates/clm`, `../job.out`, `.`.

A relative path is taken from the directory the command was started in (the process's cwd,
which under sudo is the person's own) and made absolute by its text alone, `..` included, as a
shell's `cd` reads it: nothing is looked at, no link resolved, no existence checked. Looking is
the reader's work, with the caller's rights (`owner_walk`, one component at a time from `/`),
so a root process never tells a person whether something exists or where its links lead, as
click's `exists` and `resolve_path` would, looking as root. The readers take absolute paths
only (`owner_walk.open_tree` refuses a relative one): every command's path parameter takes
`typed_path` as its callback, or its text goes through `absolute` where the command also
shows it as typed.
"""

from __future__ import annotations

import os

import click


def absolute(typed: str) -> str:
    """`typed` from the current directory, by its text alone; ValueError if it cannot be."""
    if not typed:
        raise ValueError("an empty path")
    try:
        return os.path.abspath(typed)
    except OSError as error:  # getcwd: the directory the command started in was removed
        raise ValueError(
            f"{typed!r} is relative, and the current directory is gone ({error.strerror})"
        ) from error


def typed_path(ctx: click.Context, param: click.Parameter, value: object) -> object:
    """click's callback for every path parameter: each path given (a tuple for a `multiple`
    option) made absolute from the current directory; None (not given) stays None."""
    try:
        if isinstance(value, tuple):
            return tuple(absolute(str(item)) for item in value)
        return None if value is None else absolute(str(value))
    except ValueError as error:
        raise click.BadParameter(str(error), ctx=ctx, param=param) from error
