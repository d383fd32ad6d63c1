"""Migrations up, down and up again on both databases; models and migrations agree."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session

from daemon.cli import main
from daemon.diagnosis import FailureKind
from daemon.planner import Outcome, SkippedRung
from daemon.store import action_rows, schema
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import Base, Proposal
from daemon.templates.revisions import KnobChange, Patch
from remediators.base import Lever

TABLES = {
    "lineage",
    "job",
    "incident",
    "proposal",
    "template_revision",
    "action",
    "node_event",
    "node_check",
    "audit_event",
    "cursor",
    "control_flag",
    "notification",
    "web_request",
    "awaited_record",
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


# A proposal as the code before 0004 wrote it: every key of `patch_to_json`, plus what acting
# on it and judging its relaunch added (the revision, the resumed step, the outcome).
OLD_PATCH = {
    "reason": "allocator_expandable_segments: stranded bytes would have served it",
    "changes": [
        {
            "knob": "env",
            "before": [],
            "after": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        }
    ],
    "kind": "fragmentation",
    "rung": 0,
    "ladder": ["allocator_expandable_segments", "allocator_max_split_size"],
    "lever": "allocator",
    "expected_effect": "the stranded bytes are used",
    "cost": "~0% throughput; none",
    "knobs_before": {"micro_batch": 8, "env": [], "exclude": ["gpu-03"]},
    "knobs_after": {
        "micro_batch": 8,
        "env": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        "exclude": ["gpu-03"],
    },
    "failing_step": 4,
    "actions": [{"kind": "drain", "node": "gpu-03", "reason": "medic: xid 79"}],
    "skipped": [{"rung": 1, "remediator": "allocator_gc_threshold", "reason": "budget"}],
    "resumed_step": 2,
    "revision": 1,
    "outcome": "same_failure",
    "step_reached": 3,
}


def _seed_old_proposal(engine: Engine, patch: dict[str, object]) -> None:
    """The rows a proposal hangs on, written as SQL against the 0003 schema."""
    at = {"at": "2026-01-01 00:00:00+00:00"}
    statements = [
        "INSERT INTO lineage (id, name, owner, template, status, attempts, created_at,"
        " updated_at) VALUES (1, 'run', 'alice', 't', 'active', 1, :at, :at)",
        "INSERT INTO job (id, slurm_job_id, lineage_id, attempt, name, user_name, state, nodes,"
        " record, seen_at) VALUES (1, 101, 1, 1, 'run', 'alice', 'FAILED', '[]', '{}', :at)",
        "INSERT INTO incident (id, job_id, lineage_id, slurm_job_id, user_name, kind,"
        " confidence, occurred_at, recorded_at, evidence, diagnosis) VALUES (1, 1, 1, 101,"
        " 'alice', 'fragmentation', 'high', :at, :at, '{}', '{}')",
    ]
    with engine.begin() as connection:
        for statement in statements:
            connection.execute(text(statement), at)
        connection.execute(
            text(
                "INSERT INTO proposal (id, incident_id, lineage_id, remediator, patch, rationale,"
                " cost, changes_science, state, created_at, updated_at) VALUES (1, 1, 1,"
                " 'allocator_expandable_segments', :patch, 'why', 0.0, false, 'failed', :at,"
                " :at)"
            ),
            {**at, "patch": json.dumps(patch)},
        )
        connection.execute(
            text(
                "INSERT INTO template_revision (id, lineage_id, proposal_id, knobs,"
                " rendered_script, script_sha256, created_at) VALUES (1, 1, 1, '{}', 's', 'h',"
                " :at)"
            ),
            at,
        )


def _proposal_json(engine: Engine, column: str) -> object:
    with engine.connect() as connection:
        stored = connection.execute(text(f"SELECT {column} FROM proposal")).scalar_one()
    return json.loads(stored) if isinstance(stored, str) else stored


def test_0004_carries_every_old_proposal_value_into_the_typed_record_and_back(
    empty_db_engine: Engine,
) -> None:
    schema.upgrade(empty_db_engine, "0003")
    _seed_old_proposal(empty_db_engine, OLD_PATCH)

    schema.upgrade(empty_db_engine, "0004")
    with Session(empty_db_engine) as session:
        row = session.get(Proposal, 1)
        assert row is not None
        assert (row.rung, row.lever, row.failing_step) == (0, "allocator", 4)
        assert (row.revision_id, row.resumed_step) == (1, 2)
        assert (row.outcome, row.step_reached) == ("same_failure", 3)
        record = repo.attempt_record(row)
    env = (("PYTORCH_ALLOC_CONF", "expandable_segments:True"),)
    assert record.fix.patch == Patch((KnobChange("env", (), env),), str(OLD_PATCH["reason"]))
    assert record.fix.knobs_after == {"micro_batch": 8, "env": env, "exclude": ("gpu-03",)}
    assert record.fix.knobs_before == {"micro_batch": 8, "env": (), "exclude": ("gpu-03",)}
    assert record.fix.kind is FailureKind.FRAGMENTATION
    assert record.fix.lever is Lever.ALLOCATOR
    assert record.fix.drains == ("gpu-03",)
    assert record.fix.skipped == (SkippedRung(1, "allocator_gc_threshold", "budget"),)
    assert record.outcome is Outcome.SAME_FAILURE

    schema.downgrade(empty_db_engine, "0003")
    assert _proposal_json(empty_db_engine, "patch") == OLD_PATCH


def test_0004_refuses_an_old_proposal_missing_a_key_naming_it(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine, "0003")
    renamed = {key: value for key, value in OLD_PATCH.items() if key != "failing_step"}
    _seed_old_proposal(empty_db_engine, {**renamed, "failed_at_step": 4})
    with pytest.raises(RuntimeError, match="proposal 1: its JSON lacks failing_step"):
        schema.upgrade(empty_db_engine, "0004")
    assert schema.current_revision(empty_db_engine) == "0003"


# A first submission as the code before 0005 recorded it: audit events only. (token, lineage,
# what became of it.)
FIRST_SUBMISSIONS = (
    ("medic-submitted", 2, "submitted"),
    ("medic-open", 3, "open"),
    ("medic-closed", 4, "closed"),
    ("medic-failed", 5, "failed"),
)


def _seed_first_submissions(engine: Engine) -> None:
    """At 0004: four first submissions in audit events, and the relaunch of proposal 1 with
    its action row and its `lineage_submit`."""
    at = {"at": "2026-01-01 00:00:00+00:00"}
    audit = (
        "INSERT INTO audit_event (at, actor_kind, actor_name, verb, subject_type, subject_id,"
        " details) VALUES (:at, 'user', 'alice', :verb, :type, :id, :details)"
    )

    def event(verb: str, subject: tuple[str, int], details: Mapping[str, object]) -> None:
        values = {"verb": verb, "type": subject[0], "id": str(subject[1])}
        connection.execute(text(audit), {**at, **values, "details": json.dumps(details)})

    with engine.begin() as connection:
        for token, lineage, fate in FIRST_SUBMISSIONS:
            connection.execute(
                text(
                    "INSERT INTO lineage (id, name, owner, template, status, attempts,"
                    " created_at, updated_at) VALUES (:id, 'run', 'alice', 't', 'active',"
                    " :attempts, :at, :at)"
                ),
                {**at, "id": lineage, "attempts": int(fate == "submitted")},
            )
            connection.execute(
                text(
                    "INSERT INTO template_revision (id, lineage_id, knobs, rendered_script,"
                    " script_sha256, created_at) VALUES (:id, :id, '{}', 's', 'h', :at)"
                ),
                {**at, "id": lineage},
            )
            intent = {"token": token, "revision": lineage, "owner": "alice"}
            event("submit_intent", ("lineage", lineage), intent)
            if fate == "submitted":
                submission = {
                    "lineage": lineage,
                    "attempt": 1,
                    "revision": lineage,
                    "proposal": None,
                    "token": token,
                }
                event("lineage_submit", ("job", 201), submission)
            elif fate == "closed":
                event("submit_intent_closed", ("lineage", lineage), {"token": token})
            elif fate == "failed":
                failure = {"error": "sbatch refused", "stderr": "Invalid account"}
                event("submit_failed", ("lineage", lineage), failure)
        connection.execute(
            text(
                "INSERT INTO action (proposal_id, kind, argv, token, slurm_job_id, started_at,"
                " result) VALUES (1, 'sbatch', '[]', 'medic-relaunch', 102, :at, 'succeeded')"
            ),
            at,
        )
        relaunched = {
            "lineage": 1,
            "attempt": 2,
            "revision": 1,
            "proposal": 1,
            "token": "medic-relaunch",
        }
        event("lineage_submit", ("job", 102), relaunched)


def _sbatch_rows(engine: Engine) -> dict[str, tuple[object, ...]]:
    with engine.connect() as connection:
        rows = connection.execute(
            text(
                "SELECT token, proposal_id, lineage_id, revision_id, attempt, slurm_job_id,"
                " result, stderr FROM action WHERE kind = 'sbatch'"
            )
        ).all()
    return {row[0]: tuple(row[1:]) for row in rows}


def _sbatch_tokens(engine: Engine) -> set[str]:
    with engine.connect() as connection:
        return set(
            connection.execute(text("SELECT token FROM action WHERE kind = 'sbatch'")).scalars()
        )


def _audit_tokens(engine: Engine, verb: str) -> list[str]:
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT details FROM audit_event WHERE verb = :verb ORDER BY id"), {"verb": verb}
        ).scalars()
        return [str((json.loads(d) if isinstance(d, str) else d)["token"]) for d in rows]


def test_0005_gives_every_submission_its_row_and_back(empty_db_engine: Engine) -> None:
    schema.upgrade(empty_db_engine, "0003")
    _seed_old_proposal(empty_db_engine, OLD_PATCH)
    schema.upgrade(empty_db_engine, "0004")
    _seed_first_submissions(empty_db_engine)
    intents_before = _audit_tokens(empty_db_engine, "submit_intent")
    submits_before = _audit_tokens(empty_db_engine, "lineage_submit")

    schema.upgrade(empty_db_engine, "0005")
    assert _sbatch_rows(empty_db_engine) == {
        "medic-relaunch": (1, 1, 1, 2, 102, "succeeded", None),
        "medic-submitted": (None, 2, 2, 1, 201, "succeeded", None),
        "medic-open": (None, 3, 3, 1, None, "pending", None),
        "medic-closed": (None, 4, 4, 1, None, "not_found", None),
        "medic-failed": (None, 5, 5, 1, None, "failed", "Invalid account"),
    }
    with Session(empty_db_engine) as session:
        assert records.lineage_job_ids(session) == {102: 1, 201: 2}
        found = records.lineage_submission(session, slurm_job_id=201, user="alice", comment=None)
        assert found == records.LineageSubmission(201, 2, 1, 2, None, "medic-submitted")
        assert [intent.token for intent in action_rows.pending_intents(session)] == ["medic-open"]

    schema.downgrade(empty_db_engine, "0004")
    assert _sbatch_tokens(empty_db_engine) == {"medic-relaunch"}
    # What the old code reads was there already: nothing is written twice.
    assert _audit_tokens(empty_db_engine, "submit_intent") == intents_before
    assert _audit_tokens(empty_db_engine, "lineage_submit") == submits_before


def test_0005_downgrade_writes_the_events_the_old_code_reads(empty_db_engine: Engine) -> None:
    """First submissions made by this code are rows only: downgrade puts their open intent and
    their job where the old code looks (audit events on the lineage and the job)."""
    schema.upgrade(empty_db_engine)
    with Session(empty_db_engine) as session:
        lineage = repo.create_lineage(session, name="run", owner="alice", template="t")
        revision = repo.record_template_revision(
            session, lineage_id=lineage.id, knobs={}, rendered_script="s"
        )
        lineage_id, revision_id = lineage.id, revision.id
        intents = [
            action_rows.record_submit_intent(
                session,
                lineage_id=lineage_id,
                revision_id=revision_id,
                build_argv=lambda token: [f"--comment={token}"],
                actor=repo.Actor.user("alice", 1001),
            )
            for _ in range(2)
        ]
        action_rows.record_submitted(
            session, intent=intents[1], slurm_job_id=301, actor=repo.Actor.daemon()
        )
    schema.downgrade(empty_db_engine, "0004")
    assert _sbatch_tokens(empty_db_engine) == set()
    with empty_db_engine.connect() as connection:
        open_intent = connection.execute(
            text(
                "SELECT subject_id, details FROM audit_event WHERE verb = 'submit_intent'"
                " AND subject_type = 'lineage'"
            )
        ).one()
    details = json.loads(open_intent[1]) if isinstance(open_intent[1], str) else open_intent[1]
    assert (open_intent[0], details) == (
        str(lineage_id),
        {"token": intents[0].token, "revision": revision_id, "owner": "alice"},
    )
    assert _audit_tokens(empty_db_engine, "lineage_submit") == [intents[1].token]


def test_0008_keeps_the_cursors_and_drops_only_what_it_added(empty_db_engine: Engine) -> None:
    """A cursor of the old code comes through unheld; downgrade keeps it and its position."""
    schema.upgrade(empty_db_engine, "0007")
    with empty_db_engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO cursor (name, polled_until, updated_at)"
                " VALUES ('finished_jobs', :at, :at)"
            ),
            {"at": "2026-11-30 12:00:00+00:00"},
        )
    schema.upgrade(empty_db_engine, "0008")
    with empty_db_engine.connect() as connection:
        row = connection.execute(text("SELECT name, held_since, held_reason FROM cursor")).one()
    assert tuple(row) == ("finished_jobs", None, None)
    schema.downgrade(empty_db_engine, "0007")
    assert "awaited_record" not in _tables(empty_db_engine)
    with empty_db_engine.connect() as connection:
        names = connection.execute(text("SELECT name FROM cursor")).scalars().all()
    columns = {column["name"] for column in inspect(empty_db_engine).get_columns("cursor")}
    assert names == ["finished_jobs"]
    assert columns == {"name", "polled_until", "updated_at"}
