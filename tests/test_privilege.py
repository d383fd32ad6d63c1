"""The privilege model: when root runs slurm-medic for someone else (sudo, a set-id path), the
system config alone decides policy and record; whatever the caller chose is refused, loudly.

The reproducers of issue 10 are here: alice's own config making her an admin who approves
bob's proposal, and `show --database` making root create a file where alice chose.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select

from daemon.cli import main
from daemon.config import DEFAULT_CONFIG_PATH, PrivilegeError, load_settings
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence
from daemon.privilege import ProcessIds, confinement, sudo_caller
from daemon.slurm.records import SlurmJob
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import AuditEvent, Proposal
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.e2e import MEDIC, with_system_config
from tests.factories import ended_job
from tests.fixes import seeded_fix

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users


def _alice() -> pwd.struct_passwd:
    """alice's account, looked up when a test runs (the `users` mark makes it)."""
    return pwd.getpwnam("alice")


def _alice_group() -> str:
    return grp.getgrgid(_alice().pw_gid).gr_name


ROOT_IDS = ProcessIds(uid=0, euid=0, gid=0, egid=0)


def _bobs_job() -> SlurmJob:
    end = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    return ended_job(
        4242,
        user="bob",
        uid=1002,
        name="bob's run",
        end=end,
        work_dir="/home/bob",
        stdout_path="/home/bob/run.out",
    )


@pytest.fixture
def record(tmp_path: Path) -> tuple[str, int]:
    """A record holding bob's failed job with one proposal waiting: (url, proposal id)."""
    url = sqlite_url(tmp_path / "medic.db")
    engine = make_engine(StoreSettings(url=url))
    upgrade(engine)
    with make_session_factory(engine)() as session:
        repo.record_job(session, job=_bobs_job())
        incident = repo.record_incident(
            session,
            slurm_job_id=4242,
            evidence=Evidence(job=_bobs_job()),
            diagnosis=Diagnosis(
                kind=FailureKind.TRUE_OOM, confidence=Confidence.HIGH, reasons=("no room",)
            ),
        )
        proposal = repo.propose(
            session,
            incident_id=incident.id,
            fix=seeded_fix(),
            rationale="halve the micro-batch",
            cost=1.0,
            changes_science=False,
            actor=repo.Actor.daemon(),
        )
        session.commit()
        proposal_id = proposal.id
    engine.dispose()
    return url, proposal_id


def _config(path: Path, url: str, admin_groups: tuple[str, ...] = ()) -> Path:
    groups = ", ".join(f'"{group}"' for group in admin_groups)
    path.write_text(f'[store]\nurl = "{url}"\n[policy]\nadmin_groups = [{groups}]\n')
    return path


def _as_alice_under_sudo(system_config: Path, *args: str, **env: str) -> Result:
    """`sudo slurm-medic ARGS` run by alice, with `system_config` as the system config."""
    with mock.patch("daemon.config.DEFAULT_CONFIG_PATH", system_config):
        return CliRunner().invoke(main, list(args), env={"SUDO_UID": str(_alice().pw_uid), **env})


def _state_and_approvals(url: str, proposal_id: int) -> tuple[str, list[str]]:
    engine = make_engine(StoreSettings(url=url))
    with make_session_factory(engine, read_only=True)() as session:
        proposal = session.get(Proposal, proposal_id)
        assert proposal is not None
        approvals = session.scalars(
            select(AuditEvent.actor_name).where(AuditEvent.verb == "proposal_approved")
        )
        result = (proposal.state, list(approvals))
    engine.dispose()
    return result


# ---------------------------------------------------------------- issue 10's reproducers


def test_under_sudo_a_callers_own_config_grants_no_approval(
    record: tuple[str, int], tmp_path: Path
) -> None:
    url, proposal_id = record
    system = _config(tmp_path / "system.toml", url)
    own = _config(tmp_path / "alice.toml", url, admin_groups=(_alice_group(),))

    by_flag = _as_alice_under_sudo(system, "approve", str(proposal_id), "--config", str(own))
    assert by_flag.exit_code == 2, by_flag.output
    assert "under sudo for uid 1001" in by_flag.output
    assert "refused: --config" in by_flag.output

    by_environment = _as_alice_under_sudo(
        system, "approve", str(proposal_id), SLURM_MEDIC_CONFIG=str(own)
    )
    assert by_environment.exit_code == 2
    assert "SLURM_MEDIC_CONFIG" in by_environment.output
    by_option = _as_alice_under_sudo(
        system,
        "approve",
        str(proposal_id),
        SLURM_MEDIC_POLICY__ADMIN_GROUPS=f'["{_alice_group()}"]',
    )
    assert by_option.exit_code == 2
    assert "SLURM_MEDIC_POLICY__ADMIN_GROUPS" in by_option.output

    # The system config's policy is the one that counts: alice owns nothing here.
    by_the_system = _as_alice_under_sudo(system, "approve", str(proposal_id))
    assert by_the_system.exit_code == 3
    assert "alice may not approve" in by_the_system.output
    assert _state_and_approvals(url, proposal_id) == ("proposed", [])


def test_under_sudo_the_system_config_grants_what_it_says(
    record: tuple[str, int], tmp_path: Path
) -> None:
    url, proposal_id = record
    system = _config(tmp_path / "system.toml", url, admin_groups=(_alice_group(),))
    result = _as_alice_under_sudo(system, "approve", str(proposal_id), "--json")
    assert result.exit_code == 0, result.output
    assert _state_and_approvals(url, proposal_id) == ("approved", ["alice"])


def test_under_sudo_a_database_flag_creates_nothing(tmp_path: Path) -> None:
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    system = _config(tmp_path / "system.toml", sqlite_url(tmp_path / "medic.db"))
    target = root_only / "x"
    result = _as_alice_under_sudo(system, "show", "L1", "--database", f"sqlite:///{target}")
    assert result.exit_code == 2
    assert "refused: --database" in result.output
    assert list(root_only.iterdir()) == []


# ---------------------------------------------------------------- who counts as confined


def test_sudo_counts_only_for_a_root_process_and_a_real_caller() -> None:
    assert sudo_caller({"SUDO_UID": "1001"}, real_uid=0) == 1001
    assert sudo_caller({"SUDO_UID": "1001"}, real_uid=1002) is None  # set by the user
    assert sudo_caller({"SUDO_UID": "0"}, real_uid=0) is None  # root ran sudo
    assert sudo_caller({"SUDO_UID": "1001\n"}, real_uid=0) is None  # not sudo's writing
    assert sudo_caller({}, real_uid=0) is None


def test_set_id_processes_are_confined_whatever_their_environment() -> None:
    assert confinement({}, ROOT_IDS) is None
    assert confinement({"SUDO_UID": "1001"}, ROOT_IDS) is not None
    setuid = ProcessIds(uid=1001, euid=0, gid=1001, egid=1001)
    setgid = ProcessIds(uid=1001, euid=1001, gid=1001, egid=0)
    assert "set-user/group-id" in (confinement({}, setuid) or "")
    assert "effective gid 0" in (confinement({}, setgid) or "")
    ordinary = ProcessIds(uid=1001, euid=1001, gid=1001, egid=1001)
    assert confinement({"SUDO_UID": "1002"}, ordinary) is None


def test_a_flag_setting_is_refused_under_sudo_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SUDO_UID", str(_alice().pw_uid))
    monkeypatch.setattr("daemon.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    with pytest.raises(PrivilegeError, match=r"refused: the setting policy\.dry_run"):
        load_settings(overrides={"policy": {"dry_run": True}})
    assert load_settings().policy.admin_groups == ()  # the system file alone: here, defaults


def test_a_config_in_the_callers_directory_is_never_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pydantic-settings reads a TOML file only when one is named; the caller's cwd is theirs."""
    _config(tmp_path / "config.toml", sqlite_url(tmp_path / "x.db"), admin_groups=(_alice_group(),))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUDO_UID", str(_alice().pw_uid))
    monkeypatch.setattr("daemon.config.DEFAULT_CONFIG_PATH", tmp_path / "absent" / "config.toml")
    assert load_settings().policy.admin_groups == ()


@pytest.mark.parametrize(
    "ids", [["--ruid", "alice", "--euid", "0"], ["--rgid", "alice", "--egid", "0", "--keep-groups"]]
)
def test_a_set_id_process_refuses_the_callers_config(
    ids: list[str], record: tuple[str, int], tmp_path: Path
) -> None:
    """A real process with real and effective ids apart, as a set-id wrapper would start."""
    url, _ = record
    own = _config(tmp_path / "alice.toml", url, admin_groups=(_alice_group(),))
    argv = [str(MEDIC), "status", "--config", str(own), "--json"]
    env = {"PATH": os.environ["PATH"]}
    as_root = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    assert as_root.returncode == 0, as_root.stderr
    set_id = subprocess.run(
        ["setpriv", *ids, "--", *argv], capture_output=True, text=True, env=env, check=False
    )
    assert set_id.returncode == 2, set_id.stderr
    assert "set-user/group-id" in set_id.stderr
    assert "Traceback" not in set_id.stderr


# ---------------------------------------------------------------- the e2e harness's sudo


def test_the_harness_runs_a_persons_command_on_the_system_config_path(
    record: tuple[str, int], tmp_path: Path
) -> None:
    """tests/e2e.py runs `sudo slurm-medic` for alice with its config bind-mounted over
    /etc/slurm-medic in a private mount namespace: the command reads it from the system
    path, and the host's /etc is left as it was."""
    url, _ = record
    directory = tmp_path / "etc"
    directory.mkdir()
    config = directory / DEFAULT_CONFIG_PATH.name
    config.write_text(f'[store]\nurl = "{url}"\n[policy]\ndry_run = true\n')
    host_had_config = DEFAULT_CONFIG_PATH.exists()
    env = {"PATH": os.environ["PATH"], "SUDO_UID": str(_alice().pw_uid)}
    status = [str(MEDIC), "status", "--json"]

    done = subprocess.run(
        with_system_config(config, status), capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert '"dry_run": true' in done.stdout  # the bind-mounted config, read from /etc
    assert DEFAULT_CONFIG_PATH.exists() == host_had_config
    named = subprocess.run(
        with_system_config(config, status),
        capture_output=True,
        text=True,
        env={**env, "SLURM_MEDIC_CONFIG": str(config)},
        check=False,
    )
    assert named.returncode == 2
    assert "SLURM_MEDIC_CONFIG" in named.stderr
