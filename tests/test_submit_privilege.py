"""`sudo slurm-medic submit` runs as root for a person: it may submit only as that person.

Root's right to submit as anyone (`sbatch --uid`) is the daemon's and a root shell's, not the
right of whoever a sudo rule lets run the command.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon.cli import main

TEMPLATE = Path(__file__).resolve().parents[1] / "launch_templates" / "hf-trainer"


def _user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.fail(f"no local user {name}: the test machine's set-up creates alice and bob")


@pytest.mark.skipif(os.getuid() != 0, reason="sudo's shape (real uid 0 with SUDO_UID) needs root")
def test_a_sudo_caller_cannot_submit_as_someone_else() -> None:
    alice, bob = _user("alice"), _user("bob")
    result = CliRunner().invoke(
        main,
        ["submit", str(TEMPLATE), "--as-user", bob.pw_name],
        env={"SUDO_UID": str(alice.pw_uid), "SLURM_MEDIC_CONFIG": None},
    )
    assert result.exit_code == 2, result.output
    assert "only root may submit as another user" in result.output
