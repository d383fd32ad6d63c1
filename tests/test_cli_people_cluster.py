"""`slurm-medic nodes resume` against the real local Slurm: it clears a drain slurm-medic set,
and refuses (on the record) one whose reason someone else has since written."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from daemon import process
from daemon.cli import main
from daemon.slurm.backend import SlurmCli
from daemon.store import control
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import Action, ActionKind, NodeEvent, NodeEventKind
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("devcluster")]

SPARE_NODE = "gpu-04"


def _scontrol(*args: str) -> None:
    process.run(["scontrol", *args], timeout=30, check=True)


def _restore() -> None:
    """Leave the node in service; Slurm refuses RESUME on a node that is not drained."""
    result = process.run(
        ["scontrol", "update", f"NodeName={SPARE_NODE}", "State=RESUME"], timeout=30
    )
    assert result.ok or "Invalid node state" in result.stderr, result.stderr


def _record(tmp_path: Path, reason: str) -> str:
    url = sqlite_url(tmp_path / "medic.db")
    engine = make_engine(StoreSettings(url=url))
    upgrade(engine)
    with make_session_factory(engine)() as session:
        control.record_node_event(
            session, node=SPARE_NODE, kind=NodeEventKind.DRAIN, by_medic=True, reason=reason
        )
        session.commit()
    engine.dispose()
    return url


def _resume(url: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        ["nodes", "resume", SPARE_NODE, "--why", "test", "--database", url],
        env={"SUDO_UID": ""},
    )
    return result.exit_code, result.output


def _rows(url: str) -> tuple[list[str], list[str]]:
    engine = make_engine(StoreSettings(url=url))
    with make_session_factory(engine)() as session:
        events = [event.kind for event in session.scalars(select(NodeEvent).order_by(NodeEvent.id))]
        actions = [
            action.result
            for action in session.scalars(
                select(Action).where(Action.kind == ActionKind.RESUME.value)
            )
        ]
    engine.dispose()
    return events, actions


def test_resume_clears_a_medic_drain_and_records_it(tmp_path: Path) -> None:
    cli = SlurmCli()
    reason = f"medic: cli test {uuid.uuid4().hex[:6]}"
    url = _record(tmp_path, reason)
    try:
        cli.drain(SPARE_NODE, reason)
        code, output = _resume(url)
        assert code == 0, output
        assert not cli.node(SPARE_NODE).is_drained
    finally:
        _restore()
    assert _rows(url) == (["drain", "resume"], ["succeeded"])


def test_resume_refuses_a_drain_someone_else_rewrote(tmp_path: Path) -> None:
    cli = SlurmCli()
    url = _record(tmp_path, "medic: xid 79")
    theirs = f"ops: bios update {uuid.uuid4().hex[:6]}"
    try:
        _scontrol("update", f"NodeName={SPARE_NODE}", "State=DRAIN", f"Reason={theirs}")
        code, output = _resume(url)
        assert code == 1
        assert "not set by slurm-medic" in output
        node = cli.node(SPARE_NODE)
        assert node.is_drained
        assert node.reason == theirs
    finally:
        _restore()
    assert _rows(url) == (["drain"], ["failed"])
