"""`sudo slurm-medic submit` runs as root for a person: it may submit only as that person.

Root's right to submit as anyone (`sbatch --uid`) is the daemon's and a root shell's, not the
right of whoever a sudo rule lets run the command.
"""

from __future__ import annotations

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


@pytest.mark.users
def test_a_sudo_caller_cannot_submit_as_someone_else() -> None:
    alice, bob = _user("alice"), _user("bob")
    result = CliRunner().invoke(
        main,
        ["submit", str(TEMPLATE), "--as-user", bob.pw_name],
        env={"SUDO_UID": str(alice.pw_uid), "SLURM_MEDIC_CONFIG": None},
    )
    assert result.exit_code == 2, result.output
    assert "only root may submit as another user" in result.output


@pytest.mark.users
def test_a_sudo_caller_learns_nothing_of_roots_paths(tmp_path: Path) -> None:
    """Root's 0700 directory: whether a path exists below it, and where its links lead, is the
    owner's reader's to say, and it says the same for a directory that exists and one that
    does not (click's `exists`/`resolve_path` would have looked as root)."""
    alice = _user("alice")
    hidden = tmp_path / "root-only"
    (hidden / "tpl").mkdir(parents=True)
    hidden.chmod(0o700)
    answers = []
    for name in ("tpl", "nothing-here"):
        result = CliRunner().invoke(
            main,
            ["submit", str(hidden / name)],
            env={"SUDO_UID": str(alice.pw_uid), "SLURM_MEDIC_CONFIG": None},
        )
        assert result.exit_code == 1, result.output
        answers.append(result.output.replace(name, "NAME"))
    assert answers[0] == answers[1]
    assert "denied" in answers[0]
