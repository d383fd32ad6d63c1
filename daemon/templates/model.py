"""The loaded launch template and its knobs: the record every other template module works on.

`TemplateError` lives here because every step (reading, rendering, patching) raises it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from daemon.checkpoints import CheckpointSpec
from daemon.dialects.base import Dialect, KnobError, KnobKind, KnobValue
from daemon.imported import ImportedScript, invariant_terms

EVERY_KNOB_MANAGED: Mapping[str, str] = MappingProxyType({})


class TemplateError(ValueError):
    """A template that cannot be loaded, rendered or patched, with the reason."""


VarValue = str | tuple[str, ...]


@dataclass(frozen=True)
class LaunchTemplate:
    """A loaded template: its dialect, its current knobs and everything rendering needs.

    `imported` is None for a Jinja template (every knob managed); for an imported script it
    holds the script and which knobs are managed. A knob that is not managed keeps a
    placeholder in `knobs` (the code that walks every knob needs a full mapping) that is never
    rendered, shown as a value, or changed.
    """

    name: str
    dialect: Dialect
    script_source: str
    knobs: Mapping[str, KnobValue]
    sbatch: tuple[tuple[str, str], ...] = ()
    variables: tuple[tuple[str, VarValue], ...] = ()
    config_base: Mapping[str, object] = field(default_factory=dict)
    checkpoint: CheckpointSpec | None = None
    directory: Path | None = None
    imported: ImportedScript | None = None

    @property
    def not_managed(self) -> Mapping[str, str]:
        """Knob -> why it is not managed; empty when every knob is."""
        return EVERY_KNOB_MANAGED if self.imported is None else self.imported.not_managed


def validate_knobs(
    dialect: Dialect, raw: Mapping[str, object], *, invariant: bool = True
) -> dict[str, KnobValue]:
    """Type- and range-check every knob, fill none in silently, and check the invariant
    (unless `invariant` is False: some of its terms are not known)."""
    unknown = sorted(set(raw) - {spec.name for spec in dialect.knobs})
    if unknown:
        raise KnobError(f"dialect {dialect.name} has no knob(s) {', '.join(unknown)}")
    missing = [spec.name for spec in dialect.knobs if spec.name not in raw]
    if missing:
        raise KnobError(f"missing knob(s) {', '.join(missing)} for dialect {dialect.name}")
    knobs = {spec.name: spec.validate(raw[spec.name]) for spec in dialect.knobs}
    if invariant:
        dialect.geometry(knobs)
    return knobs


def invariant_known(dialect: Dialect, not_managed: Mapping[str, str]) -> bool:
    """Whether every term of the batch invariant is managed, so that it can be checked."""
    return not any(term in not_managed for term in invariant_terms(dialect))


def parse_knob_text(dialect: Dialect, knob: str, text: str) -> KnobValue:
    """A knob value typed on a command line or found in a script, checked against its spec."""
    spec = dialect.spec(knob)
    value: object
    if spec.kind is KnobKind.INT:
        try:
            value = int(text)
        except ValueError:
            raise KnobError(f"{knob}: {text!r} is not an integer") from None
    elif spec.kind is KnobKind.BOOL:
        lowered = text.lower()
        if lowered not in {"true", "false", "1", "0", "yes", "no"}:
            raise KnobError(f"{knob}: {text!r} is not true or false")
        value = lowered in {"true", "1", "yes"}
    elif spec.kind in (KnobKind.NAMES, KnobKind.NODES):
        value = [item for item in re.split(r"[,\s]+", text) if item]
    elif spec.kind is KnobKind.ENV:
        raise KnobError(f"{knob}: set environment variables one by one")
    else:
        value = text
    return spec.validate(value)
