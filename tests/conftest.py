"""Shared pytest configuration: the plugins that bring up real services for marked tests, and
what each mark of the host's needs brings to its tests.

A test that needs something of the host says so with a mark (`root`, `users`, `chromium`,
`postgres`, `cluster`), and the mark's fixture makes it or fails naming what is missing: no
test module touches the host's users, files or services when it is imported, and nothing is
skipped for want of a set-up step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.postgres", "tests.devcluster"]

CHROMIUM = Path("/usr/bin/chromium")
# Mark -> the session fixture that gives it; first in a test's fixtures, so a module's own
# fixtures (a web record made for alice) already find what the mark promised.
NEEDS = {"root": "as_root", "users": "job_users", "chromium": "system_chromium"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", None)
        if fixtures is None:
            continue
        for mark, fixture in NEEDS.items():
            if item.get_closest_marker(mark) is not None and fixture not in fixtures:
                fixtures.insert(0, fixture)


@pytest.fixture(scope="session")
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (make test runs as root, as CI does)")


@pytest.fixture(scope="session")
def system_chromium() -> None:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: deploy/install-system-packages installs it")
