"""The one context every command runs with: settings under the privilege model, the record
opened as the command needs it, failures in one line in the command's voice, output inert."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from daemon.commands.context import (
    CommandContext,
    CommandFailed,
    MissingRecord,
    Output,
    RecordUnusable,
    Refused,
    say,
)
from daemon.privilege import ProcessIds
from daemon.store import repository as repo
from daemon.store.engine import ReadOnlySessionError, make_engine
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url

ALICE = repo.Actor.user("alice", 1001)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SLURM_MEDIC_") or name == "SUDO_UID":
            monkeypatch.delenv(name)


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[store]\nurl = "{url}"\n')
    return path


def _shown(failure: CommandFailed) -> str:
    out = io.StringIO()
    failure.show(out)
    return out.getvalue()


def test_a_set_id_process_is_refused_the_callers_config_in_the_commands_voice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_uid = ProcessIds(uid=1001, euid=0, gid=1001, egid=1001)
    monkeypatch.setattr("daemon.privilege.ProcessIds.current", lambda: set_uid)
    config = _config(tmp_path, sqlite_url(tmp_path / "medic.db"))
    with pytest.raises(Refused) as refused:
        CommandContext.load(str(config), prefix="slurm-medic run")
    assert refused.value.exit_code == 2
    shown = _shown(refused.value)
    assert shown.startswith("slurm-medic run: slurm-medic runs set-user/group-id")
    assert shown.endswith("refused: --config\n")


def test_a_config_that_cannot_be_used_exits_as_the_command_always_has(tmp_path: Path) -> None:
    bad = tmp_path / "config.toml"
    bad.write_text("[watcher]\npoll_interval_s = 0\n")
    with pytest.raises(CommandFailed) as people:
        CommandContext.load(str(bad))
    assert people.value.exit_code == 1
    assert _shown(people.value).startswith(f"Error: config {bad}: 1 bad option(s)\n")
    with pytest.raises(CommandFailed) as daemon:
        CommandContext.load(str(bad), prefix="slurm-medic submit", config_exit=2)
    assert daemon.value.exit_code == 2
    assert _shown(daemon.value).startswith(f"slurm-medic submit: config {bad}:")
    assert "watcher.poll_interval_s" in _shown(daemon.value)


def test_a_failure_shows_what_a_user_wrote_inertly() -> None:
    failure = CommandFailed("sbatch: \x1b]0;owned\x07 \u202eevil", exit_code=5, prefix="x")
    assert _shown(failure) == "x: sbatch: \\x1b]0;owned\\x07 \\u202eevil\n"
    assert failure.exit_code == 5


def test_a_reading_command_neither_creates_a_record_nor_writes_one(tmp_path: Path) -> None:
    database = tmp_path / "medic.db"
    context = CommandContext.load(str(_config(tmp_path, sqlite_url(database))))
    with pytest.raises(MissingRecord) as missing, context.session(read_only=True):
        pass
    assert missing.value.exit_code == 4
    assert not database.exists()
    upgrade(make_engine(StoreSettings(url=sqlite_url(database))))
    with context.session(read_only=True) as session:
        repo.append_audit(session, actor=ALICE, verb="v", subject_type="t", subject_id=1)
        with pytest.raises(ReadOnlySessionError):
            session.flush()
    with context.session() as session:
        repo.append_audit(session, actor=ALICE, verb="v", subject_type="t", subject_id=1)
        session.commit()
        assert session.execute(text("SELECT count(*) FROM audit_event")).scalar_one() == 1


def test_a_record_out_of_reach_is_one_line_in_the_commands_voice(tmp_path: Path) -> None:
    url = "postgresql+psycopg://medic:s3cret@127.0.0.1:1/medic"
    context = CommandContext.load(str(_config(tmp_path, url)), prefix="slurm-medic submit")
    with pytest.raises(RecordUnusable) as unusable, context.session():
        pass
    assert unusable.value.exit_code == 4
    shown = _shown(unusable.value)
    assert shown.startswith("slurm-medic submit: ")
    assert "127.0.0.1:1/medic cannot be used" in shown
    assert "s3cret" not in shown
    assert shown.count("\n") == 1


def test_output_is_one_json_document_or_a_persons_text_both_inert(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = {"owner": "mallory\u202egnp.exe", "job": 42}
    line = say(lambda shown: f"job {shown['job']} of {shown['owner']} [bold]")
    Output(as_json=True).emit(document, line)
    as_json = capsys.readouterr().out
    assert "\u202e" not in as_json
    assert json.loads(as_json) == document
    Output(as_json=False).emit(document, line)
    assert capsys.readouterr().out == "job 42 of mallory\\u202egnp.exe [bold]\n"


def test_commands_that_open_no_record_load_no_database_layer_nor_settings() -> None:
    """`diagnose --log` and `template` print and fail through the context without paying for
    SQLAlchemy, Alembic or pydantic, which only settings and the record need."""
    probe = (
        "import sys, daemon.commands.diagnose, daemon.commands.template;"
        " print(*(name in sys.modules for name in ('sqlalchemy', 'alembic', 'pydantic')))"
    )
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert output.split() == ["False", "False", "False"]


def test_a_persons_text_keeps_emoji_codes_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    Output().emit({"reason": "loss :fire: at step 7"}, say(lambda shown: shown["reason"]))
    assert capsys.readouterr().out == "loss :fire: at step 7\n"
