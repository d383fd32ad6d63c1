"""The commands for people on a real record (SQLite and PostgreSQL), seeded through the
repository: what `show` tells, who may decide, and that every decision is on the record."""

from __future__ import annotations

import grp
import json
import pwd
import socket
import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from daemon.cli import main
from daemon.commands.people import invoking_person
from daemon.commands.record_views import parse_since
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.evidence.records import (
    Evidence,
    LogFindings,
    NodeProbe,
    OomFamily,
    OomReport,
    Phase,
    ProbeVerdict,
)
from daemon.planner import SkippedRung
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import action_rows, awaited, control
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import AuditEvent, LineageStatus, NodeEventKind, Proposal
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from daemon.store.states import ProposalState
from remediators.base import Lever
from tests.factories import ended_job
from tests.fixes import seeded_fix

# The CLI as root (the record's owner, and the one who may decide): the `root` mark.
pytestmark = pytest.mark.root

NOW = datetime.now(UTC).replace(microsecond=0)
DAEMON = repo.Actor.daemon()
JOB_NAME = "llama [bold]7b[/bold]"
REASON = "reserved 79.1 GiB of 80 GiB at step 0: the activations do not fit"
SCRIPT_BEFORE = "#!/bin/bash\n#SBATCH --nodes=4\n--micro-batch-size 8 \\\n--grad-accum 4\n"
SCRIPT_AFTER = "#!/bin/bash\n#SBATCH --nodes=4\n--micro-batch-size 4 \\\n--grad-accum 8\n"
ALICE_UID = 1001


def _job(job_id: int, state: JobState, end: datetime) -> SlurmJob:
    return ended_job(
        job_id, uid=ALICE_UID, name=JOB_NAME, state=state, end=end, nodes=("gpu-01", "gpu-02")
    )


@dataclass(frozen=True)
class Seeded:
    url: str
    lineage_id: int
    proposal_id: int  # verified, decided by alice
    waiting_id: int  # a second failure's proposal, waiting for a person
    config: Path


def _seed(session: Session) -> tuple[int, int, int]:
    """A lineage whose first attempt died of a true OOM, was fixed, relaunched and verified;
    and an unrelated job whose proposal waits for a person."""
    lineage = repo.create_lineage(session, name=JOB_NAME, owner="alice", template="llama-7b")
    first = _job(1001, JobState.FAILED, NOW - timedelta(hours=3))
    repo.record_job(session, job=first, lineage_id=lineage.id, attempt=1)
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        requested_bytes=2 * 2**30,
        total_bytes=80 * 2**30,
        reserved_bytes=79 * 2**30,
    )
    evidence = Evidence(
        log=LogFindings(rank=3, node="gpu-02", step=0, phase=Phase.FORWARD, oom=oom),
        job=first,
        probe=NodeProbe(
            node="gpu-02", probed_at=NOW, verdict=ProbeVerdict.HEALTHY, reasons=("no XID",)
        ),
    )
    diagnosis = Diagnosis(
        kind=FailureKind.TRUE_OOM,
        confidence=Confidence.HIGH,
        reasons=(REASON,),
        onset=Onset.STEP0,
        rank=3,
        node="gpu-02",
        step=0,
        phase=Phase.FORWARD,
        oom=oom,
    )
    incident = repo.record_incident(
        session, slurm_job_id=1001, evidence=evidence, diagnosis=diagnosis
    )
    fix = seeded_fix(
        changes=(("micro_batch", 8, 4), ("grad_accum", 4, 8)),
        expected_effect="activations halve; the peak drops by about 20 GiB",
        skipped=(SkippedRung(0, "allocator_expandable_segments", "no gap"),),
        failing_step=0,
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=fix,
        rationale="micro-batch 8 -> 4, grad-accum 4 -> 8: the global batch is kept",
        cost=1.0,
        changes_science=False,
        actor=DAEMON,
    )
    parent = repo.record_template_revision(
        session, lineage_id=lineage.id, knobs={"micro_batch": 8}, rendered_script=SCRIPT_BEFORE
    )
    relaunched = repo.record_template_revision(
        session,
        lineage_id=lineage.id,
        knobs={"micro_batch": 4},
        rendered_script=SCRIPT_AFTER,
        parent_id=parent.id,
        proposal_id=proposal.id,
    )
    repo.record_relaunch_revision(
        session, proposal=proposal, revision_id=relaunched.id, resumed_step=0
    )
    repo.transition_proposal(
        session,
        proposal_id=proposal.id,
        to=ProposalState.APPROVED,
        actor=repo.Actor.user("alice", ALICE_UID),
        reason="fine, the global batch is kept",
    )
    intent = action_rows.record_submit_intent(
        session,
        proposal_id=proposal.id,
        build_argv=lambda token: ["sbatch", f"--comment={token}", "job.sh"],
        actor=DAEMON,
    )
    action_rows.record_submitted(session, intent=intent, slurm_job_id=1002, actor=DAEMON)
    repo.record_job(
        session,
        job=_job(1002, JobState.COMPLETED, NOW - timedelta(hours=1)),
        lineage_id=lineage.id,
        attempt=2,
    )
    control.record_node_event(
        session,
        node="gpu-02",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: test drain",
        incident_id=incident.id,
    )
    control.record_node_event(
        session, node="gpu-02", kind=NodeEventKind.RESUME, by_medic=True, reason="test over"
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="job_handled",
        subject_type="job",
        subject_id=1001,
        details={"outcome": "proposed", "token": "medic-secret"},
    )
    for state in (ProposalState.VERIFYING, ProposalState.VERIFIED):
        repo.transition_proposal(session, proposal_id=proposal.id, to=state, actor=DAEMON)
    repo.set_lineage_status(
        session,
        lineage_id=lineage.id,
        status=LineageStatus.VERIFIED,
        actor=DAEMON,
        reason="passed step 2 and wrote checkpoint-100",
    )
    other = _job(2001, JobState.FAILED, NOW - timedelta(minutes=30))
    repo.record_job(session, job=other)
    fragmented = repo.record_incident(
        session,
        slurm_job_id=2001,
        evidence=Evidence(job=other),
        diagnosis=Diagnosis(
            kind=FailureKind.FRAGMENTATION, confidence=Confidence.MEDIUM, reasons=("split",)
        ),
    )
    waiting = repo.propose(
        session,
        incident_id=fragmented.id,
        fix=seeded_fix("sequence_length_down", (("seq_len", 4096, 2048),), lever=Lever.SEQUENCE),
        rationale="shorter sequences [red]change the science[/red]",
        cost=3.0,
        changes_science=True,
        actor=DAEMON,
    )
    session.commit()
    return lineage.id, proposal.id, waiting.id


def _write_config(path: Path, url: str, admin_groups: tuple[str, ...] = ()) -> Path:
    groups = ", ".join(f'"{group}"' for group in admin_groups)
    path.write_text(f'[store]\nurl = "{url}"\n\n[policy]\nadmin_groups = [{groups}]\n')
    return path


@pytest.fixture
def seeded(empty_db_engine: Engine, tmp_path: Path) -> Seeded:
    upgrade(empty_db_engine)
    with make_session_factory(empty_db_engine)() as session:
        lineage_id, proposal_id, waiting_id = _seed(session)
    url = empty_db_engine.url.render_as_string(hide_password=False)
    config = _write_config(tmp_path / "config.toml", url)
    return Seeded(url, lineage_id, proposal_id, waiting_id, config)


def _cli(seeded: Seeded, *args: str, sudo_uid: int | None = None) -> Result:
    """As root with `--config`; with `sudo_uid`, as sudo runs it for that user, where only the
    system config counts (`--config` is refused there): the seeded config stands in for it."""
    env = {"COLUMNS": "250", "SUDO_UID": str(sudo_uid) if sudo_uid is not None else ""}
    if sudo_uid is None:
        return CliRunner().invoke(main, [*args, "--config", str(seeded.config)], env=env)
    with mock.patch("daemon.config.DEFAULT_CONFIG_PATH", seeded.config):
        return CliRunner().invoke(main, list(args), env=env)


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _audit(seeded: Seeded, engine: Engine, verb: str) -> list[AuditEvent]:
    with make_session_factory(engine)() as session:
        return list(session.scalars(select(AuditEvent).where(AuditEvent.verb == verb)))


def _proposal(engine: Engine, proposal_id: int) -> Proposal:
    with make_session_factory(engine)() as session:
        proposal = session.get(Proposal, proposal_id)
        assert proposal is not None
        return proposal


# ---------------------------------------------------------------- show and history


def test_show_tells_the_whole_story_of_a_run(seeded: Seeded) -> None:
    result = _cli(seeded, "show", f"L{seeded.lineage_id}")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "attempt 1: job 1001" in text
    assert "attempt 2: job 1002" in text
    assert JOB_NAME in text  # markup in a job name is shown, never interpreted
    assert f"because: {REASON}" in text
    assert "diagnosis: true_oom (high confidence) onset step0" in text
    assert "requested 2.00 GiB, total 80.00 GiB" in text
    assert "micro_batch: 8 -> 4" in text
    assert "---micro-batch-size 8 \\" in text
    assert "+--micro-batch-size 4 \\" in text
    assert "proposal_approved by alice: fine, the global batch is kept" in text
    assert (
        "FAILED: micro_batch_down, approved by alice, relaunched as job 1002, now verified" in text
    )
    assert "status verified" in text
    assert "node gpu-02 drain by slurm-medic" in text
    assert "expected: activations halve; the peak drops by about 20 GiB" in text
    assert "skipped allocator_expandable_segments: no gap" in text
    assert "resumed from the checkpoint at step 0" in text
    assert "job_handled by slurm-medic: outcome proposed" in text
    assert "medic-secret" not in text


def test_show_a_job_id_tells_its_lineage_story_as_json(seeded: Seeded) -> None:
    document = _json(_cli(seeded, "show", "1002", "--json"))
    assert document["asked_for_job"] == 1002
    assert document["lineage"]["status"] == "verified"
    first, second = document["attempts"]
    assert first["incidents"][0]["reasons"] == [REASON]
    assert first["incidents"][0]["probe"]["verdict"] == "healthy"
    proposal = first["proposals"][0]
    assert proposal["decided_by"] == "alice"
    assert proposal["changes"][1] == {"knob": "grad_accum", "before": 4, "after": 8}
    assert "+--grad-accum 8" in proposal["diff"]
    approvals = [event for event in proposal["trail"] if event["verb"] == "proposal_approved"]
    assert [(e["who"], e["reason"]) for e in approvals] == [
        ("alice", "fine, the global batch is kept")
    ]
    assert second["job"]["state"] == "COMPLETED"


def test_show_refuses_what_the_record_does_not_hold(seeded: Seeded) -> None:
    assert _cli(seeded, "show", "L999").exit_code == 1
    missing = _cli(seeded, "show", "31337")
    assert missing.exit_code == 1
    assert "job 31337 is not in the record" in missing.output
    assert _cli(seeded, "show", "1001; rm -rf /").exit_code == 2


def test_history_filters_by_kind_user_and_time(seeded: Seeded) -> None:
    everything = _json(_cli(seeded, "history", "--json"))
    assert [row["job"] for row in everything["incidents"]] == [2001, 1001]
    assert everything["incidents"][1]["proposals"][0]["state"] == "verified"
    fragmentation = _json(_cli(seeded, "history", "--kind", "fragmentation", "--json"))
    assert [row["job"] for row in fragmentation["incidents"]] == [2001]
    assert _json(_cli(seeded, "history", "--user", "bob", "--json"))["incidents"] == []
    recent = _json(_cli(seeded, "history", "--since", "1h", "--json"))
    assert [row["job"] for row in recent["incidents"]] == [2001]
    table = _cli(seeded, "history", "--user", "alice")
    assert "micro_batch_down verified" in table.output
    assert _cli(seeded, "history", "--since", "last tuesday").exit_code == 2


def test_since_accepts_durations_and_dates() -> None:
    now = datetime(2026, 11, 22, 12, tzinfo=UTC)
    assert parse_since("2d", now) == datetime(2026, 11, 20, 12, tzinfo=UTC)
    assert parse_since("2026-11-01", now) == datetime(2026, 11, 1, tzinfo=UTC)


# ---------------------------------------------------------------- status


def test_status_lists_waiting_proposals_drains_and_the_pause(
    seeded: Seeded, empty_db_engine: Engine
) -> None:
    with make_session_factory(empty_db_engine)() as session:
        control.record_node_event(
            session, node="gpu-03", kind=NodeEventKind.DRAIN, by_medic=True, reason="medic: XID 79"
        )
        control.set_cursor(session, name="finished", polled_until=NOW)
        session.commit()
    document = _json(_cli(seeded, "status", "--json"))
    assert document["paused"] is False
    assert [row["id"] for row in document["pending_approvals"]] == [seeded.waiting_id]
    assert document["pending_approvals"][0]["owner"] == "alice"
    assert [row["node"] for row in document["drains"]] == ["gpu-03"]
    assert document["polls"] == [{"watcher": "finished", "polled_until": NOW.isoformat()}]
    text = _cli(seeded, "status").output
    assert "[red]change the science[/red]" in text
    assert "medic: XID 79" in text


def test_status_shows_the_records_in_flight(seeded: Seeded, empty_db_engine: Engine) -> None:
    """During an accounting outage: the held cursor and why, and each managed job that ended
    with no record in accounting yet."""
    with make_session_factory(empty_db_engine)() as session:
        control.hold_cursor(
            session,
            name="finished_jobs",
            reason="accounting unreachable: slurmdbd: Connection refused",
            now=NOW,
            start=NOW - timedelta(minutes=5),
        )
        awaited.note_awaited(
            session,
            slurm_job_id=4242,
            lineage_id=seeded.lineage_id,
            now=NOW,
            accounting="accounting unreachable",
        )
        session.commit()
    shown = _json(_cli(seeded, "status", "--json"))["records_in_flight"]
    assert shown["held"] == [
        {
            "watcher": "finished_jobs",
            "polled_until": (NOW - timedelta(minutes=5)).isoformat(),
            "since": NOW.isoformat(),
            "reason": "accounting unreachable: slurmdbd: Connection refused",
        }
    ]
    assert [(row["job"], row["looks"]) for row in shown["awaited"]] == [(4242, 1)]
    text = _cli(seeded, "status").output
    assert "records in flight: finished_jobs held at" in text
    assert "ended, record not yet in accounting" in text
    assert "4242" in text


# ---------------------------------------------------------------- decisions


@pytest.mark.users
def test_the_owner_approves_with_a_comment_on_the_record(
    seeded: Seeded, empty_db_engine: Engine
) -> None:
    result = _cli(
        seeded,
        "approve",
        str(seeded.waiting_id),
        "--comment",
        "ok for this run",
        "--json",
        sudo_uid=ALICE_UID,
    )
    assert _json(result)["grounds"] == "job owner"
    proposal = _proposal(empty_db_engine, seeded.waiting_id)
    assert proposal.state == ProposalState.APPROVED.value
    assert proposal.decided_by == "alice"
    approved = _audit(seeded, empty_db_engine, "proposal_approved")
    mine = [event for event in approved if event.subject_id == str(seeded.waiting_id)]
    assert [(e.actor_name, e.actor_uid, e.details["reason"]) for e in mine] == [
        ("alice", ALICE_UID, "ok for this run")
    ]
    again = _cli(seeded, "approve", str(seeded.waiting_id), sudo_uid=ALICE_UID)
    assert again.exit_code == 3
    assert "is approved" in again.output


def test_a_stranger_may_not_decide_and_the_attempt_is_recorded(
    seeded: Seeded, empty_db_engine: Engine
) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    result = _cli(seeded, "approve", str(seeded.waiting_id), sudo_uid=nobody)
    assert result.exit_code == 3
    assert "nobody may not approve" in result.output
    assert _proposal(empty_db_engine, seeded.waiting_id).state == ProposalState.PROPOSED.value
    refused = _audit(seeded, empty_db_engine, "approve_refused")
    assert [(event.actor_name, event.subject_id) for event in refused] == [
        ("nobody", str(seeded.waiting_id))
    ]


def test_an_admin_group_member_rejects_and_must_say_why(
    seeded: Seeded, empty_db_engine: Engine, tmp_path: Path
) -> None:
    nobody = pwd.getpwnam("nobody")
    admin_group = _group_of(nobody.pw_gid)
    _write_config(seeded.config, seeded.url, (admin_group,))
    assert _cli(seeded, "reject", str(seeded.waiting_id), sudo_uid=nobody.pw_uid).exit_code == 2
    result = _cli(
        seeded,
        "reject",
        str(seeded.waiting_id),
        "--why",
        "changes the science",
        "--json",
        sudo_uid=nobody.pw_uid,
    )
    assert _json(result)["grounds"] == f"admin group {admin_group}"
    proposal = _proposal(empty_db_engine, seeded.waiting_id)
    assert (proposal.state, proposal.decided_by) == ("rejected", "nobody")
    rejected = _audit(seeded, empty_db_engine, "proposal_rejected")
    assert [event.details["reason"] for event in rejected] == ["changes the science"]


def _group_of(gid: int) -> str:
    return grp.getgrgid(gid).gr_name


@pytest.mark.users
def test_sudo_uid_is_believed_only_from_root() -> None:
    assert invoking_person({"SUDO_UID": "0"}, uid=ALICE_UID).name == "alice"
    as_alice = invoking_person({"SUDO_UID": str(pwd.getpwnam("nobody").pw_uid)}, uid=ALICE_UID)
    assert (as_alice.name, as_alice.is_root) == ("alice", False)
    through_sudo = invoking_person({"SUDO_UID": str(ALICE_UID)}, uid=0)
    assert (through_sudo.name, through_sudo.is_root) == ("alice", False)
    fullwidth_1001 = "\uff11\uff10\uff10\uff11"
    assert invoking_person({"SUDO_UID": fullwidth_1001}, uid=0).is_root  # not ASCII digits


# ---------------------------------------------------------------- pause and nodes


def test_pause_and_resume_are_on_the_record(seeded: Seeded, empty_db_engine: Engine) -> None:
    assert _cli(seeded, "pause", "--why", "driver upgrade").exit_code == 0
    paused = _json(_cli(seeded, "status", "--json"))
    assert paused["paused"] is True
    assert (paused["pause"]["by"], paused["pause"]["reason"]) == ("root", "driver upgrade")
    assert _cli(seeded, "pause", sudo_uid=ALICE_UID).exit_code == 3
    assert _cli(seeded, "resume").exit_code == 0
    assert _json(_cli(seeded, "status", "--json"))["paused"] is False
    verbs = [e.verb for e in _audit(seeded, empty_db_engine, "pause")] + [
        e.verb for e in _audit(seeded, empty_db_engine, "unpause")
    ]
    assert verbs == ["pause", "unpause"]


@pytest.mark.users
def test_nodes_lists_medic_drains_and_refuses_to_resume_others(
    seeded: Seeded, empty_db_engine: Engine
) -> None:
    with make_session_factory(empty_db_engine)() as session:
        control.record_node_event(
            session, node="gpu-03", kind=NodeEventKind.DRAIN, by_medic=True, reason="medic: XID 79"
        )
        control.record_node_event(
            session, node="gpu-04", kind=NodeEventKind.DRAIN, by_medic=False, reason="bios update"
        )
        session.commit()
    listed = _json(_cli(seeded, "nodes", "--json"))
    assert [row["node"] for row in listed["drains"]] == ["gpu-03"]
    refused = _cli(seeded, "nodes", "resume", "gpu-04")
    assert refused.exit_code == 3
    assert "no slurm-medic drain of gpu-04" in refused.output
    assert _cli(seeded, "nodes", "resume", "-gpu-03").exit_code == 2
    assert _cli(seeded, "nodes", "resume", "gpu-03", sudo_uid=ALICE_UID).exit_code == 3
    refused_resume = _audit(seeded, empty_db_engine, "node_resume_refused")
    assert [(event.actor_name, event.subject_id) for event in refused_resume] == [
        ("alice", "gpu-03")
    ]


# ---------------------------------------------------------------- a record that cannot be used


def _on(config: Path, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--config", str(config)], env={"SUDO_UID": ""})


def _one_line(result: Result) -> str:
    """The command ended with one line for a person, never a traceback."""
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.output.count("\n") == 1, result.output
    return result.output


@pytest.mark.parametrize(
    "args", [["status"], ["history"], ["show", "L1"], ["nodes"], ["approve", "1"], ["pause"]]
)
def test_no_command_but_db_upgrade_creates_the_record(tmp_path: Path, args: list[str]) -> None:
    database = tmp_path / "medic.db"
    config = _write_config(tmp_path / "config.toml", f"sqlite:///{database}")
    result = _on(config, *args)
    assert result.exit_code == 4
    assert f"no record at {database}: run `slurm-medic db upgrade`" in _one_line(result)
    assert not database.exists()
    current = _on(config, "db", "current")
    assert current.exit_code == 1
    assert f"current: empty (no record at {database}" in current.output
    assert not database.exists()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("problem", "said"),
    [
        ("corrupt", "file is not a database"),
        ("directory", "medic.db is not a file"),
        ("no schema", "has no schema; run `slurm-medic db upgrade`"),
        ("postgres down", "Connection refused"),
    ],
)
def test_a_record_that_cannot_be_used_is_one_line_and_exit_4(
    tmp_path: Path, problem: str, said: str
) -> None:
    database = tmp_path / "medic.db"
    url = f"sqlite:///{database}"
    if problem == "corrupt":
        database.write_bytes(b"not a database, whatever the name says " * 100)
    elif problem == "directory":
        database.mkdir()
    elif problem == "no schema":
        database.touch()
    else:
        url = f"postgresql://medic:s3cret@127.0.0.1:{_closed_port()}/medic"
    config = _write_config(tmp_path / "config.toml", url)
    for args in (["status"], ["show", "L1", "--json"], ["reject", "1", "--why", "no"]):
        result = _on(config, *args)
        assert result.exit_code == 4, result.output
        assert said in _one_line(result)
        assert "s3cret" not in result.output


def test_a_locked_record_is_one_line_the_harness_can_retry_on(tmp_path: Path) -> None:
    database = tmp_path / "medic.db"
    engine = make_engine(StoreSettings(url=sqlite_url(database)))
    upgrade(engine)
    engine.dispose()
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{database}"\nsqlite_busy_timeout_ms = 50\n')
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        result = _on(config, "pause", "--why", "driver upgrade")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert result.exit_code == 4
    assert "database is locked" in _one_line(result)


def test_db_failures_are_one_line_and_exit_4(tmp_path: Path) -> None:
    database = tmp_path / "medic.db"
    config = _write_config(tmp_path / "config.toml", f"sqlite:///{database}")
    unknown = _on(config, "db", "upgrade", "nosuch")
    assert unknown.exit_code == 4
    assert "migration refused: Can't locate revision identified by 'nosuch'" in _one_line(unknown)
    nowhere = _write_config(tmp_path / "nowhere.toml", f"sqlite:///{tmp_path}/absent/medic.db")
    unreachable = _on(nowhere, "db", "upgrade")
    assert unreachable.exit_code == 4
    assert "unable to open database file" in _one_line(unreachable)
    missing = _write_config(tmp_path / "missing.toml", f"sqlite:///{tmp_path}/missing.db")
    downgrade = _on(missing, "db", "downgrade", "base")
    assert downgrade.exit_code == 4
    assert "no record at" in _one_line(downgrade)
    assert not (tmp_path / "missing.db").exists()
