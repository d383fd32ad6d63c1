"""The suite asks for what it needs with marks, and takes nothing of the host when a module is
imported: a test module that looked up a user at import stopped `make test` at collection on a
machine where the local cluster never came up. Read from the source (ast): whatever runs at
import (module and class bodies, decorators, default values) calls no user, group, process or
socket API and skips nothing."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# What reaches the host's accounts, processes or services: never at import.
HOST_MODULES = frozenset({"pwd", "grp", "spwd", "subprocess", "socket", "getpass"})
HOST_CALLS = frozenset({"getpwnam", "getpwuid", "getgrnam", "getgrgid", "getlogin", "home"})


def evaluated_at_import(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node Python evaluates when the module is imported: not function bodies."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            pending.extend(node.decorator_list)
            pending.extend(node.args.defaults)
            pending.extend(default for default in node.args.kw_defaults if default is not None)
            continue
        if isinstance(node, ast.Lambda):
            pending.extend(node.args.defaults)
            continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


def host_calls_at_import(source: str) -> list[str]:
    """`line: call` for each call at import that reaches the host, or that skips."""
    found: list[str] = []
    for node in evaluated_at_import(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        name = ast.unparse(function)
        if isinstance(function, ast.Attribute):
            owner = ast.unparse(function.value)
            if owner in HOST_MODULES or function.attr in HOST_CALLS or function.attr == "skipif":
                found.append(f"{node.lineno}: {name}")
        elif isinstance(function, ast.Name) and function.id in HOST_CALLS:
            found.append(f"{node.lineno}: {name}")
    return found


def test_the_checker_sees_a_lookup_a_skip_and_a_subprocess_at_import() -> None:
    source = (
        "import pwd, subprocess, pytest\n"
        "ALICE = pwd.getpwnam('alice')\n"
        "class Case:\n"
        "    OUT = subprocess.run(['id'])\n"
        "    def method(self) -> None:\n"
        "        pwd.getpwnam('bob')\n"
        "@pytest.mark.skipif(True, reason='x')\n"
        "def test_it(user=pwd.getpwuid(0)) -> None:\n"
        "    pwd.getpwnam('carol')\n"
    )
    assert sorted(host_calls_at_import(source)) == [
        "2: pwd.getpwnam",
        "4: subprocess.run",
        "7: pytest.mark.skipif",
        "8: pwd.getpwuid",
    ]


@pytest.mark.parametrize(
    "module", sorted(TESTS.rglob("*.py")), ids=lambda path: str(path.relative_to(TESTS))
)
def test_no_test_module_takes_the_host_at_import(module: Path) -> None:
    assert host_calls_at_import(module.read_text()) == []
