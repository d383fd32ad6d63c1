"""The framework dialects slurm-medic knows, in one explicit registry."""

from __future__ import annotations

from collections.abc import Mapping

from daemon.dialects import deepspeed, hf, megatron, torchrun
from daemon.dialects.base import Dialect, KnobError

DIALECTS: Mapping[str, Dialect] = {
    dialect.name: dialect
    for dialect in (hf.DIALECT, megatron.DIALECT, deepspeed.DIALECT, torchrun.DIALECT)
}


def get_dialect(name: str) -> Dialect:
    try:
        return DIALECTS[name]
    except KeyError:
        raise KnobError(f"unknown dialect {name!r}; known: {', '.join(DIALECTS)}") from None
