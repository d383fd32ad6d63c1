"""Node and environment names in knobs: a trailing newline must not pass as part of a name.

`$` in a Python pattern also matches before a final newline, so `gpu-01\n` would reach
`#SBATCH --exclude=` and an `export` line with a line break in it.
"""

from __future__ import annotations

import pytest

from daemon.dialects import get_dialect
from daemon.dialects.base import KnobError


@pytest.mark.parametrize("node", ["gpu-01\n", "gpu-01\r\n", "gpu-01\nrm"])
def test_a_node_name_with_a_line_break_is_refused(node: str) -> None:
    spec = get_dialect("hf").spec("exclude")
    with pytest.raises(KnobError):
        spec.validate([node])
    assert spec.validate(["gpu-01"]) == ("gpu-01",)


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF\n", "A\nB"])
def test_an_environment_name_with_a_line_break_is_refused(name: str) -> None:
    spec = get_dialect("hf").spec("env")
    with pytest.raises(KnobError):
        spec.validate({name: "x"})
    assert spec.validate({"PYTORCH_ALLOC_CONF": "x"}) == (("PYTORCH_ALLOC_CONF", "x"),)
