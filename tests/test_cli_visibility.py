"""Under sudo, `show`, `status` and `history` show what the web page shows (issue 23): a person
sees their own runs and the nodes' public facts, an admin (root itself, or a member of
`policy.admin_groups`) sees everything, and another's run is "not in the record".
"""

from __future__ import annotations

import grp
import json
import pwd
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner, Result

from daemon.cli import main
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence, LogFindings
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import NodeEventKind
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.factories import ended_job
from tests.fixes import seeded_fix

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users


def _alice() -> pwd.struct_passwd:
    """Looked up when a test runs: the `users` mark makes the accounts."""
    return pwd.getpwnam("alice")


def _bob() -> pwd.struct_passwd:
    return pwd.getpwnam("bob")


def _alice_group() -> str:
    return grp.getgrgid(_alice().pw_gid).gr_name


NOW = datetime.now(UTC).replace(microsecond=0)
NODE = "gpu-02"
# Every string of bob's run that alice must never be shown.
BOBS_SECRETS = (
    "bob-secret-run",
    "bob-secret-line",
    "bob-secret-reason",
    "bob-secret-rationale",
    "/home/bob/secret.out",
    "bob",
)


@dataclass(frozen=True)
class Seeded:
    url: str
    alice_lineage: int
    bob_lineage: int
    alice_proposal: int
    bob_proposal: int


def _run(
    session: Any, *, owner: pwd.struct_passwd, job_id: int, words: str, lineage: bool = True
) -> tuple[int | None, int]:
    """A failed job of `owner` on NODE with a waiting proposal: (lineage id, proposal id)."""
    lineage_id = None
    if lineage:
        lineage_id = repo.create_lineage(
            session, name=f"{words}-run", owner=owner.pw_name, template="llama"
        ).id
    job = ended_job(
        job_id,
        user=owner.pw_name,
        uid=owner.pw_uid,
        name=f"{words}-run",
        end=NOW - timedelta(minutes=30),
        nodes=(NODE,),
        stdout_path=f"/home/{owner.pw_name}/secret.out",
    )
    repo.record_job(session, job=job, lineage_id=lineage_id, attempt=1 if lineage else None)
    incident = repo.record_incident(
        session,
        slurm_job_id=job_id,
        evidence=Evidence(job=job, log=LogFindings(root_failure_line=f"{words}-line")),
        diagnosis=Diagnosis(
            kind=FailureKind.TRUE_OOM,
            confidence=Confidence.HIGH,
            reasons=(f"{words}-reason",),
            node=NODE,
        ),
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(),
        rationale=f"{words}-rationale",
        cost=1.0,
        changes_science=False,
        actor=repo.Actor.daemon(),
    )
    return lineage_id, proposal.id


@pytest.fixture
def seeded(tmp_path: Path) -> Seeded:
    """alice's run and bob's (each a lineage, a failure on NODE, a waiting proposal), a job of
    bob's outside any lineage, and a drain of NODE by slurm-medic."""
    url = sqlite_url(tmp_path / "medic.db")
    engine = make_engine(StoreSettings(url=url))
    upgrade(engine)
    with make_session_factory(engine)() as session:
        alice_lineage, alice_proposal = _run(session, owner=_alice(), job_id=1001, words="alice")
        bob_lineage, bob_proposal = _run(session, owner=_bob(), job_id=4242, words="bob-secret")
        _run(session, owner=_bob(), job_id=4343, words="bob-secret", lineage=False)
        control.record_node_event(
            session, node=NODE, kind=NodeEventKind.DRAIN, by_medic=True, reason="medic: XID 79"
        )
        session.commit()
    engine.dispose()
    assert alice_lineage is not None
    assert bob_lineage is not None
    return Seeded(url, alice_lineage, bob_lineage, alice_proposal, bob_proposal)


def _config(tmp_path: Path, url: str, *, admin_groups: tuple[str, ...] = (), web: str = "") -> Path:
    groups = ", ".join(f'"{group}"' for group in admin_groups)
    path = tmp_path / "system-config.toml"
    path.write_text(f'[store]\nurl = "{url}"\n[policy]\nadmin_groups = [{groups}]\n{web}')
    return path


def _cli(config: Path, *args: str, sudo: pwd.struct_passwd | None) -> Result:
    """`sudo slurm-medic ARGS` as `sudo` runs it for that person (only the system config
    counts: `config` stands in for it); with `sudo=None`, root itself."""
    env = {"COLUMNS": "250", "SUDO_UID": "" if sudo is None else str(sudo.pw_uid)}
    with mock.patch("daemon.config.DEFAULT_CONFIG_PATH", config):
        return CliRunner().invoke(main, list(args), env=env)


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _leaks(text: str) -> list[str]:
    return [secret for secret in BOBS_SECRETS if secret in text]


# ---------------------------------------------------------------- a person under sudo


def test_under_sudo_status_lists_only_the_callers_runs_and_approvals(
    seeded: Seeded, tmp_path: Path
) -> None:
    config = _config(tmp_path, seeded.url)
    document = _json(_cli(config, "status", "--json", sudo=_alice()))
    assert [row["owner"] for row in document["active_lineages"]] == ["alice"]
    assert [row["id"] for row in document["pending_approvals"]] == [seeded.alice_proposal]
    assert [row["node"] for row in document["drains"]] == [NODE]  # the cluster's, for everyone
    assert _leaks(json.dumps(document)) == []
    text = _cli(config, "status", sudo=_alice())
    assert text.exit_code == 0, text.output
    assert "alice-rationale" in text.output
    assert "medic: XID 79" in text.output
    assert "only the runs of alice are shown" in text.output
    assert _leaks(text.output) == []


def test_under_sudo_history_lists_only_the_callers_failures(seeded: Seeded, tmp_path: Path) -> None:
    config = _config(tmp_path, seeded.url)
    document = _json(_cli(config, "history", "--json", sudo=_alice()))
    assert [row["job"] for row in document["incidents"]] == [1001]
    assert (
        _json(_cli(config, "history", "--user", "bob", "--json", sudo=_alice()))["incidents"] == []
    )
    mine = _json(_cli(config, "history", "--user", "alice", "--json", sudo=_alice()))
    assert [row["job"] for row in mine["incidents"]] == [1001]
    text = _cli(config, "history", sudo=_alice())
    assert text.exit_code == 0, text.output
    assert "1001" in text.output
    assert _leaks(text.output) == []


@pytest.mark.parametrize("as_json", [False, True])
def test_under_sudo_anothers_run_is_not_in_the_record(
    seeded: Seeded, tmp_path: Path, as_json: bool
) -> None:
    config = _config(tmp_path, seeded.url)
    flags = ["--json"] if as_json else []
    missing_lineage = _cli(config, "show", "L999999", *flags, sudo=_alice())
    for reference, absent in (
        (f"L{seeded.bob_lineage}", f"no lineage {seeded.bob_lineage} in the record"),
        ("4242", "job 4242 is not in the record"),  # a job of bob's lineage
        ("4343", "job 4343 is not in the record"),  # bob's job outside any lineage
    ):
        result = _cli(config, "show", reference, *flags, sudo=_alice())
        assert result.exit_code == missing_lineage.exit_code == 1
        assert result.output == f"Error: {absent}\n"
        assert _leaks(result.output.replace(absent, "")) == []
    own = _cli(config, "show", f"L{seeded.alice_lineage}", *flags, sudo=_alice())
    assert own.exit_code == 0, own.output
    assert "alice-reason" in own.output


def test_under_sudo_a_nodes_story_keeps_only_the_callers_incidents(
    seeded: Seeded, tmp_path: Path
) -> None:
    config = _config(tmp_path, seeded.url)
    document = _json(_cli(config, "show", NODE, "--json", sudo=_alice()))
    incidents = [entry for entry in document["story"] if entry["what"] == "incident"]
    assert [entry["job"] for entry in incidents] == [1001]
    assert any(entry["what"] == "drain" for entry in document["story"])
    text = _cli(config, "show", NODE, sudo=_alice())
    assert text.exit_code == 0, text.output
    assert _leaks(text.output) == []


def test_bob_under_sudo_sees_his_runs_and_not_alices(seeded: Seeded, tmp_path: Path) -> None:
    config = _config(tmp_path, seeded.url)
    status = _json(_cli(config, "status", "--json", sudo=_bob()))
    assert {row["owner"] for row in status["pending_approvals"]} == {"bob"}
    history = _json(_cli(config, "history", "--json", sudo=_bob()))
    assert sorted(row["job"] for row in history["incidents"]) == [4242, 4343]
    assert _cli(config, "show", f"L{seeded.alice_lineage}", sudo=_bob()).exit_code == 1


# ---------------------------------------------------------------- who sees everything


def _sees_everything(config: Path, seeded: Seeded, sudo: pwd.struct_passwd | None) -> None:
    status = _json(_cli(config, "status", "--json", sudo=sudo))
    assert {row["owner"] for row in status["active_lineages"]} == {"alice", "bob"}
    assert {row["id"] for row in status["pending_approvals"]} >= {
        seeded.alice_proposal,
        seeded.bob_proposal,
    }
    history = _json(_cli(config, "history", "--json", sudo=sudo))
    assert sorted(row["job"] for row in history["incidents"]) == [1001, 4242, 4343]
    shown = _cli(config, "show", f"L{seeded.bob_lineage}", sudo=sudo)
    assert shown.exit_code == 0, shown.output
    assert "bob-secret-reason" in shown.output
    assert _cli(config, "show", "4343", "--json", sudo=sudo).exit_code == 0
    node = _json(_cli(config, "show", NODE, "--json", sudo=sudo))
    assert sorted(e["job"] for e in node["story"] if e["what"] == "incident") == [1001, 4242, 4343]
    assert "only the runs of" not in _cli(config, "status", sudo=sudo).output


def test_root_itself_sees_every_run(seeded: Seeded, tmp_path: Path) -> None:
    _sees_everything(_config(tmp_path, seeded.url), seeded, sudo=None)


def test_an_admin_group_member_under_sudo_sees_every_run(seeded: Seeded, tmp_path: Path) -> None:
    config = _config(tmp_path, seeded.url, admin_groups=(_alice_group(),))
    _sees_everything(config, seeded, sudo=_alice())


def test_a_site_that_lets_everyone_see_all_lets_the_cli_too(seeded: Seeded, tmp_path: Path) -> None:
    """One rule with the web: `web.everyone_sees_all` in the system config."""
    config = _config(tmp_path, seeded.url, web="[web]\neveryone_sees_all = true\n")
    _sees_everything(config, seeded, sudo=_alice())
