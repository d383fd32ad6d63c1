"""Exactly once on the real cluster when `slurm-medic submit` dies right after sbatch: the
daemon finds the job by its token and follows it.

The death is made at the Slurm seam: a backend whose `submit` raises `SystemExit` (which no
step catches) after the real sbatch, as a SIGKILL at that moment would leave it. The daemon's
own deaths around a relaunch's sbatch are real SIGKILLs of `slurm-medic run`
(test_crash_cluster.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from daemon.config import load_settings
from daemon.service import Daemon
from daemon.slurm.backend import SlurmCli
from daemon.store import action_rows
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.engine import make_session_factory
from daemon.store.models import Incident
from daemon.store.service_records import carries_token
from daemon.submission import ACCOUNTED_STATES, Sbatch, submit_new_lineage
from daemon.templates.reading import load_template
from daemon.templates.revisions import initial_revision, knobs_to_json
from tests.devcluster import DevCluster
from tests.test_service_cluster import (
    USER,
    configure,
    cycle_until,
    daemon_for,
    make_template,
    proposals,
)
from tests.test_service_cluster import work_dir as work_dir_fixture

pytestmark = [pytest.mark.cluster]

work_dir = work_dir_fixture


class DiesAfterSbatch(SlurmCli):
    """The real backend, except that the process 'dies' right after the real sbatch."""

    def submit(
        self,
        script: str,
        *,
        as_user: str,
        comment: str | None = None,
        exclude_nodes: Iterable[str] = (),
        extra_args: Sequence[str] = (),
        work_dir: str | None = None,
    ) -> int:
        super().submit(
            script,
            as_user=as_user,
            comment=comment,
            exclude_nodes=exclude_nodes,
            extra_args=extra_args,
            work_dir=work_dir,
        )
        raise SystemExit("killed")


def jobs_with(daemon: Daemon, token: str) -> list[int]:
    """Jobs carrying `token`: slurmctld's queue (live and recently ended) and accounting."""
    now = datetime.now(UTC)
    ended = SlurmCli().finished_jobs(now - timedelta(minutes=10), now, states=ACCOUNTED_STATES)
    found = {
        job.job_id for job in daemon.backend.queued_jobs() if carries_token(job.comment, token)
    }
    found |= {job.job_id for job in ended if carries_token(job.comment, token)}
    return sorted(found)


def test_a_first_submission_whose_cli_died_is_found_and_followed(
    devcluster: DevCluster, work_dir: Path
) -> None:
    """`slurm-medic submit` killed right after sbatch: its intent and token are on the record,
    the job is not; the daemon finds the job by its token and closes the loop on it."""
    config = configure(work_dir, devcluster)
    directory = make_template(work_dir, "torchrun", "fragmentation", {})
    settings = load_settings(config)
    daemon = daemon_for(settings)
    template = load_template(directory)
    first = initial_revision(template)
    with make_session_factory(daemon.engine)() as session:
        with pytest.raises(SystemExit):
            submit_new_lineage(
                session,
                DiesAfterSbatch(),
                Sbatch(first.script, USER, str(work_dir)),
                name=template.name,
                template_dir=str(directory),
                knobs=knobs_to_json(first.knobs),
                actor=repo.Actor.user("root", 0),
            )
        session.rollback()
        (intent,) = action_rows.pending_intents(session)
    (job_id,) = jobs_with(daemon, intent.token)
    daemon.start()
    cycle_until(
        daemon, lambda: any(p.state == "verified" for p in proposals(daemon)), timeout_s=150
    )
    with make_session_factory(daemon.engine)() as session:
        found = records.lineage_submission(session, slurm_job_id=job_id, user="alice", comment=None)
        incident = session.scalars(select(Incident)).one()
    assert found is not None
    assert (found.lineage_id, found.attempt, found.token) == (intent.lineage_id, 1, intent.token)
    assert incident.slurm_job_id == job_id
    daemon.leader.release()
