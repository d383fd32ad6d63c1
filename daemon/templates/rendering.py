"""A launch template and its knobs made into an sbatch script.

A Jinja template renders in the sandbox (`daemon.templates.sandbox`) with its context built
here; an imported script has its knobs spliced in place (`daemon.imported_render`). Every
failure, whatever Python raises inside Jinja, is a `TemplateError`.
"""

from __future__ import annotations

from collections.abc import Sequence

from jinja2 import TemplateError as JinjaTemplateError

from daemon.dialects.base import Dialect, KnobError, Knobs, KnobValue
from daemon.imported import SpliceError
from daemon.imported_render import splice
from daemon.templates.model import LaunchTemplate, TemplateError
from daemon.templates.sandbox import (
    ShellSafe,
    bounded_render,
    compiled,
    shell_join,
    shell_quote,
)

# What Python or Jinja can raise while a user's template renders; all become TemplateError.
_RENDER_FAILURES = (
    JinjaTemplateError,  # SecurityError, UndefinedError, TemplateSyntaxError
    KnobError,
    ArithmeticError,  # OverflowError, ZeroDivisionError
    LookupError,
    TypeError,
    ValueError,  # UnicodeError
    AttributeError,
    RecursionError,
    MemoryError,
)


def render(template: LaunchTemplate, knobs: Knobs | None = None) -> str:
    """The sbatch script for these knobs (the template's own when None)."""
    values = template.knobs if knobs is None else knobs
    dialect = template.dialect
    if template.imported is not None:
        try:
            return splice(dialect, template.imported, values)
        except SpliceError as error:
            raise TemplateError(f"template {template.name}: {error}") from error
    try:
        context = {
            "sbatch_header": _sbatch_header(template, values),
            "env_exports": _env_exports(dialect, values),
            "train_args": _args_block(dialect.render_args(values)),
            "config_json": ShellSafe(dialect.render_config(values, template.config_base) or ""),
            "knobs": dict(values),
            "vars": dict(template.variables),
            "name": template.name,
        }
        return bounded_render(compiled(template.script_source), context)
    except TemplateError as error:
        raise TemplateError(f"template {template.name}: {error}") from error
    except _RENDER_FAILURES as error:
        raise TemplateError(f"template {template.name}: {type(error).__name__}: {error}") from error


def _sbatch_header(template: LaunchTemplate, knobs: Knobs) -> ShellSafe:
    nodes, gpus, exclude = knobs["nodes"], knobs["gpus_per_node"], knobs["exclude"]
    lines = [f"#SBATCH --nodes={nodes}", f"#SBATCH --gres=gpu:{gpus}"]
    if isinstance(exclude, tuple) and exclude:
        lines.append(f"#SBATCH --exclude={','.join(str(node) for node in exclude)}")
    lines += [
        f"#SBATCH --{key}={value}" if value else f"#SBATCH --{key}"
        for key, value in template.sbatch
    ]
    return ShellSafe("\n".join(lines))


def _args_block(args: Sequence[str]) -> ShellSafe:
    """One flag and its values per line, so a revision's diff shows exactly the knob that moved."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([])
        groups[-1].append(arg)
    return ShellSafe(" \\\n    ".join(shell_join(group) for group in groups))


def _env_exports(dialect: Dialect, knobs: Knobs) -> ShellSafe:
    env = knobs["env"]
    pairs = [(str(pair[0]), str(pair[1])) for pair in _pairs(env)]
    pairs += list(dialect.render_env(knobs))
    return ShellSafe("\n".join(f"export {key}={shell_quote(value)}" for key, value in pairs))


def _pairs(value: KnobValue) -> list[tuple[str, str]]:
    if not isinstance(value, tuple):
        return []
    return [(str(pair[0]), str(pair[1])) for pair in value if isinstance(pair, tuple)]
