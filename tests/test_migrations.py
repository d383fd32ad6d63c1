"""Migrations up, down and up again on both databases; models and migrations agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import Engine, inspect, text

from daemon.cli import main
from daemon.store import schema
from daemon.store.models import Base

TABLES = {
    "lineage",
    "job",
    "incident",
    "proposal",
    "template_revision",
    "action",
    "node_event",
    "audit_event",
    "cursor",
    "control_flag",
}


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def _model_drift(engine: Engine) -> list[object]:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))


def _insert_audit_row(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO audit_event (at, actor_kind, actor_name, verb, subject_type,"
                " subject_id, details) VALUES (:at, 'daemon', 'slurm-medic', 'x', 't', '1', '{}')"
            ),
            {"at": "2026-01-01 00:00:00+00:00"},
        )


def _try_update_audit(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("UPDATE audit_event SET verb = 'changed'"))


def test_upgrade_downgrade_upgrade(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine)
    assert _tables(empty_db_engine) == TABLES
    assert schema.current_revision(empty_db_engine) == schema.head_revision()

    schema.downgrade(empty_db_engine, "base")
    assert _tables(empty_db_engine) == set()
    assert schema.current_revision(empty_db_engine) is None

    schema.upgrade(empty_db_engine)
    assert _tables(empty_db_engine) == TABLES
    assert _model_drift(empty_db_engine) == []


def test_models_and_migrations_agree(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine)
    assert _model_drift(empty_db_engine) == []


def test_drift_would_be_seen(empty_db_engine: Engine) -> None:
    """The agreement check is not vacuous: a missing index shows up as drift."""
    schema.upgrade(empty_db_engine)
    with empty_db_engine.begin() as connection:
        connection.execute(text("DROP INDEX ix_incident_kind_occurred"))
    drift = _model_drift(empty_db_engine)
    assert any("ix_incident_kind_occurred" in repr(change) for change in drift)


def test_append_only_triggers_come_and_go_with_their_revision(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine)
    _insert_audit_row(empty_db_engine)
    with pytest.raises(Exception, match="append-only"):
        _try_update_audit(empty_db_engine)

    schema.downgrade(empty_db_engine, "0001")
    _try_update_audit(empty_db_engine)
    with empty_db_engine.connect() as connection:
        assert connection.execute(text("SELECT verb FROM audit_event")).scalar_one() == "changed"

    schema.upgrade(empty_db_engine)
    with pytest.raises(Exception, match="append-only"):
        _try_update_audit(empty_db_engine)


def test_empty_database_is_refused_naming_the_command(empty_db_engine: Engine) -> None:
    with pytest.raises(schema.SchemaBehind, match="slurm-medic db upgrade"):
        schema.check_schema_current(empty_db_engine)


def test_database_behind_is_refused(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine, "0001")
    with pytest.raises(
        schema.SchemaBehind, match=r"at revision 0001, behind .*slurm-medic db upgrade"
    ):
        schema.check_schema_current(empty_db_engine)
    schema.upgrade(empty_db_engine)
    schema.check_schema_current(empty_db_engine)


def test_database_ahead_of_the_code_is_refused(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine)
    with empty_db_engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'from_the_future'"))
    with pytest.raises(schema.SchemaBehind, match="does not know"):
        schema.check_schema_current(empty_db_engine)


def test_cli_upgrade_current_downgrade(empty_db_engine: Engine) -> None:
    url = empty_db_engine.url.render_as_string(hide_password=False)
    runner = CliRunner()

    behind = runner.invoke(main, ["db", "current", "--database", url])
    assert behind.exit_code == 1
    assert "slurm-medic db upgrade" in behind.output

    upgraded = runner.invoke(main, ["db", "upgrade", "--database", url])
    assert upgraded.exit_code == 0, upgraded.output
    assert f"empty -> {schema.head_revision()}" in upgraded.output

    current = runner.invoke(main, ["db", "current", "--database", url])
    assert current.exit_code == 0
    assert f"current: {schema.head_revision()}" in current.output

    down = runner.invoke(main, ["db", "downgrade", "base", "--database", url])
    assert down.exit_code == 0, down.output
    assert _tables(empty_db_engine) == set()


def test_cli_takes_the_record_from_the_config_file_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`db` finds the record where every other command does: --config, SLURM_MEDIC_CONFIG."""
    database = tmp_path / "from-config.db"
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{database}"\n')
    runner = CliRunner()

    upgraded = runner.invoke(main, ["db", "upgrade", "--config", str(config)])
    assert upgraded.exit_code == 0, upgraded.output
    assert f"empty -> {schema.head_revision()}" in upgraded.output
    assert database.exists()

    monkeypatch.setenv("SLURM_MEDIC_CONFIG", str(config))
    current = runner.invoke(main, ["db", "current"])
    assert current.exit_code == 0, current.output
    assert f"current: {schema.head_revision()}" in current.output

    missing = runner.invoke(main, ["db", "current", "--config", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 1
    assert "does not exist" in missing.output


def test_cli_refuses_a_foreign_database_url() -> None:
    result = CliRunner().invoke(main, ["db", "current", "--database", "mysql://host/db"])
    assert result.exit_code == 2
    assert "sqlite and postgresql" in result.output


def test_migration_files_sort_by_date_in_revision_order() -> None:
    directory = ScriptDirectory.from_config(schema.alembic_config())
    oldest_first = [script.revision for script in reversed(list(directory.walk_revisions()))]
    files = sorted(path.name for path in (schema.migrations_dir() / "versions").glob("2*.py"))
    assert [re.sub(r"^\d{4}_\d\d_\d\d_\d{4}-(\w+?)_.*", r"\1", name) for name in files] == (
        oldest_first
    )


def test_migrations_are_found_inside_the_package() -> None:
    import migrations

    assert schema.migrations_dir() == Path(migrations.__file__).parent
    assert (schema.migrations_dir() / "env.py").is_file()
    assert (schema.migrations_dir() / "script.py.mako").is_file()
