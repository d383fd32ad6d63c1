"""A relaunch's inputs are its owner's (issue 23, findings 2 and 6).

- The template directory and the files it names are the owner's (or root's) and writable by no
  one else: a template another user can change between two relaunches would run their command
  as the owner. Refused with the reason, on the record.
- A template is loaded whole in a child with a deadline and a memory cap (`templates.bounded`):
  one that does not load in time is an incident's "template refused: ...", the job handled and
  the cycle going on.
- A job joins a lineage as its owner carrying its token, never by its Slurm job id alone:
  Slurm reuses ids, and another user's job under a reused id must not join (nor be approved for)
  someone else's lineage.

These run as root (the daemon's case) with the local users alice and bob.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.config import Settings
from daemon.gather import OwnerJobFiles
from daemon.owner_files import Owner
from daemon.pipeline import PipelineDeps, handle_ended_job
from daemon.store import service_records as records
from daemon.store.models import Action, AuditEvent, Lineage
from daemon.templates import bounded
from daemon.templates.bounded import read_template_bounded
from daemon.templates.model import TemplateError
from daemon.templates.reading import TemplateReader, load_template
from tests.test_owner_files import alice_owner, owned_dir
from tests.test_pipeline import FakeFiles, failed_job, start_lineage
from tests.test_pipeline_owner import OOM_LINE

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

EXAMPLE = Path(__file__).resolve().parent.parent / "launch_templates" / "torchrun"


@pytest.fixture
def alice() -> Owner:
    return alice_owner()


@pytest.fixture
def alice_dir(alice: Owner) -> Iterator[Path]:
    with owned_dir(alice) as home:
        yield home


def _template_of(owner: Owner, parent: Path) -> Path:
    directory = parent / "tpl"
    shutil.copytree(EXAMPLE, directory)
    for item in [directory, *directory.rglob("*")]:
        os.lchown(item, owner.uid, owner.gid)
    return directory


def _bounded(owner: Owner) -> TemplateReader:
    return lambda path: read_template_bounded(owner, path, drop_privileges=True)


# ---------------------------------------------------------------- whose template


def test_the_owners_own_template_loads_in_the_bounded_child(alice: Owner, alice_dir: Path) -> None:
    directory = _template_of(alice, alice_dir)
    template = load_template(directory, _bounded(alice))
    assert template.name == load_template(EXAMPLE).name
    assert template.script_source == load_template(EXAMPLE).script_source


def test_a_template_another_user_owns_is_refused_for_a_relaunch(
    alice: Owner, alice_dir: Path
) -> None:
    bob = Owner.from_name("bob")
    shared = alice_dir.parent / "bobs"
    shared.mkdir()
    directory = _template_of(bob, shared)
    with pytest.raises(TemplateError, match=r"exposed: .*belongs to uid \d+, not to the template"):
        load_template(directory, _bounded(alice))


@pytest.mark.parametrize("target", [".", "template.toml", "job.sbatch.j2"])
@pytest.mark.parametrize("mode_bits", [0o020, 0o002])
def test_a_template_others_may_write_is_refused(
    alice: Owner, alice_dir: Path, target: str, mode_bits: int
) -> None:
    directory = _template_of(alice, alice_dir)
    path = directory / target
    path.chmod(path.stat().st_mode | mode_bits)
    with pytest.raises(TemplateError, match=r"exposed: .*may be written by others"):
        load_template(directory, _bounded(alice))


def test_a_template_root_owns_is_the_sites_and_loads(alice: Owner) -> None:
    assert load_template(EXAMPLE, _bounded(alice)).name == load_template(EXAMPLE).name


# ---------------------------------------------------------------- a load with a deadline


def test_a_template_that_does_not_load_in_time_is_refused(alice: Owner, alice_dir: Path) -> None:
    """The child's deadline, made shorter than the interpreter's start, stands in for a
    template the importer would chew on for minutes: the daemon waits no longer than it."""
    directory = _template_of(alice, alice_dir)
    with pytest.raises(TemplateError, match=r"template refused: .* did not load within 0\.01s"):
        read_template_bounded(alice, str(directory), drop_privileges=True, timeout_s=0.01)


def test_a_template_that_does_not_load_in_time_is_an_incident_and_the_job_is_handled(
    alice: Owner, alice_dir: Path, db_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _template_of(alice, alice_dir)
    lineage_id = start_lineage(db_session, 9401)
    lineage = db_session.get(Lineage, lineage_id)
    assert lineage is not None
    lineage.template = str(directory)
    log = alice_dir / "job.out"
    log.write_text("step 3/12\n" + OOM_LINE)
    os.chown(log, alice.uid, alice.gid)
    job = dataclasses.replace(
        failed_job(9401), uid=alice.uid, stdout_path=str(log), work_dir=str(alice_dir)
    )
    monkeypatch.setattr(bounded, "LOAD_TIMEOUT_S", 0.01)
    result = handle_ended_job(
        db_session, job, PipelineDeps(settings=Settings(), prober=None, files=OwnerJobFiles())
    )
    assert result.outcome == "template_error"
    assert "template refused" in result.detail
    assert result.incident_id is not None
    assert records.handled_job_ids(db_session, slurm_job_ids=[9401]) == {9401}
    details = " ".join(str(event.details) for event in db_session.scalars(select(AuditEvent)))
    assert "template refused" in details


# ---------------------------------------------------------------- who joins a lineage


def test_another_users_job_under_a_reused_id_joins_no_lineage(db_session: Session) -> None:
    start_lineage(db_session, 9501)  # alice's lineage; her job was 9501
    bobs = dataclasses.replace(failed_job(9501), user="bob", uid=1002, group="bob")
    assert (
        records.lineage_submission(db_session, slurm_job_id=9501, user="bob", comment=None) is None
    )
    settings = Settings()
    result = handle_ended_job(
        db_session, bobs, PipelineDeps(settings=settings, prober=None, files=FakeFiles({}))
    )
    assert result.outcome == "unmanaged"
    assert result.incident_id is None


def test_a_job_whose_comment_lacks_the_token_joins_no_lineage(db_session: Session) -> None:
    """Where accounting keeps comments, the token is the proof: alice's own later job under a
    reused id carries another comment (or none of slurm-medic's) and is not the relaunch."""
    start_lineage(db_session, 9601)
    token = db_session.scalars(select(Action.token).where(Action.slurm_job_id == 9601)).one()
    assert (
        records.lineage_submission(
            db_session, slurm_job_id=9601, user="alice", comment="my own notes"
        )
        is None
    )
    found = records.lineage_submission(
        db_session, slurm_job_id=9601, user="alice", comment=f"notes {token}"
    )
    assert found is not None
    assert found.token == token
