"""Imports flow one way: no module of the daemon imports, however indirectly, one that imports
it back. Read from the source (ast), imports inside functions included: a lazy import is
still a loop, only hidden."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "remediators")


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name)."""
    names: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load: `from a import b` names `a.b` first
    (b may be a module), then `a`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, node.module] if node.module else base)
    else:
        prefix = node.module or ""
    return [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (anywhere in its source). A package's
    own `__init__` is left out as a target: importing `daemon.x` runs `daemon` first, always,
    and that is not a loop the code wrote."""
    modules = module_names(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            candidates = _imported(node, name, is_package)
            if not candidates:
                continue
            if isinstance(node, ast.ImportFrom):
                found = {c for c in candidates[:-1] if c in modules}
                found = found or ({candidates[-1]} & set(modules))
            else:
                found = {c for c in candidates if c in modules}
            targets |= found
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import loop as the path around it (first module repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, pending = stack[-1]
            if not pending:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            nxt = pending.pop(0)
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt in done:
                continue
            stack.append((nxt, sorted(graph.get(nxt, ()))))
            path.append(nxt)
            on_path.add(nxt)
    return None


def test_the_daemon_imports_flow_one_way() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert "daemon.verify" in graph["daemon.pipeline"]  # the graph sees real imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_judging_of_relaunches_sits_below_the_pipeline() -> None:
    """Verification gathers through `daemon.gather`; nothing it imports leads to the pipeline."""
    graph = import_graph(ROOT, PACKAGES)
    below_verify: set[str] = set()
    frontier = ["daemon.verify"]
    while frontier:
        for target in graph[frontier.pop()]:
            if target not in below_verify:
                below_verify.add(target)
                frontier.append(target)
    assert "daemon.gather" in below_verify
    assert "daemon.pipeline" not in below_verify


def test_a_lazy_import_inside_a_function_is_a_loop_too(tmp_path: Path) -> None:
    """What the pipeline and verify used to do: one imports the other at the top, the other
    imports it back inside a function. Relative imports resolve as Python resolves them."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipeline.py").write_text(
        "def completed():\n    from pkg.verify import finish\n    return finish\n"
    )
    (package / "verify.py").write_text("from .pipeline import completed\n")
    (package / "other.py").write_text("from . import verify\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.other"] == {"pkg.verify"}
    cycle = find_cycle(graph)
    assert cycle is not None
    assert (len(cycle), set(cycle)) == (3, {"pkg.pipeline", "pkg.verify"})


def test_a_graph_without_a_loop_has_none() -> None:
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
