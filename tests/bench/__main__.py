"""`make bench`: runs each `tests/bench/bench_*.py` module's `main()`, or the ones named."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import tests.bench


def main(argv: list[str]) -> int:
    names = sorted(
        info.name
        for info in pkgutil.iter_modules(tests.bench.__path__)
        if info.name.startswith("bench_")
    )
    wanted = [name for name in names if not argv or name.removeprefix("bench_") in argv]
    for name in wanted:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"tests.bench.{name}")
        module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
