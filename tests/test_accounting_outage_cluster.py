"""No managed failure lost to an accounting outage, on the real cluster.

slurmdbd is stopped for several times the poll's overlap while three managed runs fail: early,
in the middle and late in the outage. During it `slurm-medic status` shows the records in
flight; after it each failure is diagnosed and relaunched exactly once. The same with
slurmctld restarted in the middle of the outage (it keeps the records it holds for slurmdbd
across the restart), and with the daemon itself restarted in the middle of it. slurmctld
forgets each ended job within seconds (MinJobAge=5 s) while accounting has no record of it:
only the daemon's own knowledge of its jobs, and a cursor that waits for slurmctld's queue to
slurmdbd to drain, find them again; a job of bob's that fails in the outage, managed by a
`[managed]` rule and no lineage, is found by the cursor alone.

Each test prints how long after slurmdbd came back each failure was handled (the README's
reliability figures).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from daemon import process
from daemon.store.models import Action, AuditEvent, Incident
from daemon.watch import CURSOR
from tests.devcluster import DevCluster, job_state, sbatch_as, script
from tests.e2e import (
    FINAL_PROPOSAL_STATES,
    Medic,
    Scenario,
    jobs_with_token,
    make_template,
    make_work_dir,
)
from tests.test_e2e_cluster import probe_settings

pytestmark = [pytest.mark.cluster]

STATE = Path("/var/lib/slurm-medic-devcluster")
OVERLAP_S = 10
OUTAGE_S = 55  # five and a half times the overlap
# When each run is submitted, from the moment slurmdbd stopped; each fails within seconds.
SUBMIT_AT_S = {"early": 1, "middle": 16, "late": 32}
HANDLED_TIMEOUT_S = 150


@dataclass(frozen=True)
class Run:
    label: str
    name: str
    lineage: int
    job: int


@pytest.fixture
def work_dir() -> Path:
    return make_work_dir("medic-outage")


def stop(pid_file: Path, what: str) -> None:
    """SIGTERM, as `systemctl stop` sends it, then wait until the process is gone."""
    pid = int(pid_file.read_text().strip())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (pid {pid}) did not stop within 30 s")
        time.sleep(0.1)


def restart_slurmctld() -> None:
    """Stop slurmctld and start it again on its saved state, as a site's restart does."""
    stop(STATE / "run" / "slurmctld.pid", "slurmctld")
    subprocess.run(["slurmctld"], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while "is UP" not in process.run(["scontrol", "ping"], timeout=15).stdout:
        if time.monotonic() > deadline:
            raise AssertionError("slurmctld did not answer within 60 s of its restart")
        time.sleep(0.2)


def ended(job_id: int) -> bool:
    """slurmctld shows the job ended, or has forgotten it already."""
    state = job_state(str(job_id))
    return state is None or state not in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}


def wait_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


def wait_ended(medic: Medic, run: Run) -> None:
    medic.wait_for(f"the {run.label} run ended", lambda: ended(run.job), 60)


def handled_at(medic: Medic, job_id: int) -> datetime | None:
    with medic.session() as session:
        found = list(
            session.scalars(
                select(AuditEvent.at).where(
                    AuditEvent.verb == "job_handled", AuditEvent.subject_id == str(job_id)
                )
            )
        )
    assert len(found) <= 1, f"job {job_id} handled {len(found)} times"
    if not found:
        return None
    return found[0] if found[0].tzinfo is not None else found[0].replace(tzinfo=UTC)


def accounted_end(job_id: int) -> tuple[str, datetime]:
    shown = process.run(
        ["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State,End"], timeout=30, check=True
    ).stdout.split()[0]
    state, _, end = shown.partition("|")
    return state, datetime.fromisoformat(end).astimezone(UTC)


def check_once(medic: Medic, run: Run) -> int:
    """One incident, one proposal, one relaunch in Slurm, each token on one job; the relaunch."""
    assert [incident.slurm_job_id for incident in medic.incidents(run.lineage)] == [run.job]
    proposals = medic.proposals(run.lineage)
    assert len(proposals) == 1, [(p.id, p.state) for p in proposals]
    relaunch = proposals[0].relaunch_job_id
    assert relaunch is not None
    with medic.session() as session:
        sbatch = list(
            session.scalars(
                select(Action).where(Action.kind == "sbatch", Action.lineage_id == run.lineage)
            )
        )
    assert sorted(a.slurm_job_id or 0 for a in sbatch if a.result == "succeeded") == sorted(
        [run.job, relaunch]
    )
    for action in sbatch:
        assert len(jobs_with_token(action.token)) == 1, action.token
    return relaunch


def outage(devcluster: DevCluster, work_dir: Path, restart: str | None) -> None:
    """slurmdbd down OUTAGE_S while three runs fail; `restart` (slurmctld, daemon) is
    restarted in the middle of the outage. Every failure handled once after it."""
    suffix = work_dir.name.rsplit("-", 1)[-1]
    # bob's jobs are managed by a rule, no lineage: only the held cursor can find his.
    managed = '[managed]\nusers = ["bob"]\n'
    medic = Medic(work_dir, probe_settings(devcluster), overlap_s=OVERLAP_S, extra_config=managed)
    medic.prepare()
    templates = {
        label: make_template(
            work_dir,
            Scenario(
                f"outage-{label}-{suffix}",
                "torchrun",
                "fragmentation",
                one_rank_per_node=True,
                real=False,
            ),
        )
        for label in SUBMIT_AT_S
    }
    medic.start()
    runs: list[Run] = []
    try:
        medic.wait_for("a first poll", lambda: polled(medic), 60)
        stop(STATE / "run" / "slurmdbd.pid", "slurmdbd")
        down = time.monotonic()
        try:
            for label, at_s in SUBMIT_AT_S.items():
                wait_until(down + at_s)
                lineage, job, _token = medic.submit(templates[label])
                runs.append(Run(label, f"e2e-outage-{label}-{suffix}", lineage, job))
                wait_ended(medic, runs[-1])
                if label == "early":
                    plain = plain_failure(work_dir, suffix)
                if label == "middle" and restart == "slurmctld":
                    restart_slurmctld()
                elif label == "middle" and restart == "daemon":
                    assert medic.stop() == 0
                    time.sleep(2)
                    medic.start()
            # A cycle takes seconds while Slurm does not answer (each read is retried).
            jobs = sorted(run.job for run in runs)
            shown = medic.wait_for(
                "every ended run shown in flight",
                lambda: in_flight(medic, jobs),
                down + OUTAGE_S - 2 - time.monotonic(),
            )
            [held] = shown["held"]
            assert held["watcher"] == CURSOR
            assert "accounting unreachable" in held["reason"], held
            for run in runs:
                assert medic.incidents(run.lineage) == []
            wait_until(down + OUTAGE_S)
        finally:
            script(["up"], timeout=240)  # the devcluster's own way to start slurmdbd
        back = datetime.now(UTC)
        down_s = time.monotonic() - down
        figures = []
        for run in runs:
            at = medic.wait_for(
                f"the {run.label} failure handled",
                partial(handled_at, medic, run.job),
                HANDLED_TIMEOUT_S,
            )
            figures.append(f"{run.label} {(at - back).total_seconds():.1f} s")
        at = medic.wait_for(
            "bob's failure (a [managed] rule's) handled",
            partial(handled_at, medic, plain),
            HANDLED_TIMEOUT_S,
        )
        figures.append(f"bob's {(at - back).total_seconds():.1f} s")
        for run in runs:
            medic.wait_for(
                f"the {run.label} run's relaunch decided",
                partial(medic.proposal_in, run.lineage, FINAL_PROPOSAL_STATES),
                HANDLED_TIMEOUT_S,
            )
        outage_start = back.timestamp() - down_s
        for run in runs:
            state, end = accounted_end(run.job)
            assert state == "FAILED"
            assert outage_start < end.timestamp() < back.timestamp(), (run.label, end)
            check_once(medic, run)
            assert [p.state for p in medic.proposals(run.lineage)] == ["verified"]
        with medic.session() as session:
            diagnosed = session.scalars(
                select(Incident.slurm_job_id).where(Incident.slurm_job_id == plain)
            ).all()
        assert diagnosed == [plain]
        assert accounted_end(plain)[0] == "FAILED"
        shown = json.loads(medic.cli("status", "--json").stdout)["records_in_flight"]
        assert shown == {"held": [], "awaited": []}
        print(
            f"\noutage of {down_s:.0f} s (overlap {OVERLAP_S} s), restart {restart or 'none'}:"
            f" handled after slurmdbd returned: {', '.join(figures)}"
        )
    finally:
        if medic.alive():
            medic.stop()
        medic.dispose()


def plain_failure(work_dir: Path, suffix: str) -> int:
    """A job of bob's that fails at once, submitted with plain sbatch (no lineage)."""
    bob_dir = work_dir / "bob"
    bob_dir.mkdir()
    shutil.chown(bob_dir, "bob", "bob")
    script_path = bob_dir / "plain.sbatch"
    script_path.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --output={bob_dir}/plain-%j.out\n"
        "echo 'RuntimeError: the data loader is gone'\n"
        "exit 1\n",
        encoding="utf-8",
    )
    job = int(sbatch_as("bob", bob_dir, f"outage-plain-{suffix}", script_path))
    deadline = time.monotonic() + 60
    while not ended(job):
        if time.monotonic() > deadline:
            raise AssertionError(f"bob's job {job} did not end within 60 s")
        time.sleep(0.5)
    return job


def in_flight(medic: Medic, jobs: list[int]) -> dict[str, Any] | None:
    """`status --json`'s records in flight, once it shows every one of these jobs awaited."""
    shown: dict[str, Any] = json.loads(medic.cli("status", "--json").stdout)["records_in_flight"]
    return shown if sorted(row["job"] for row in shown["awaited"]) == jobs else None


def polled(medic: Medic) -> bool:
    return bool(json.loads(medic.cli("status", "--json").stdout)["polls"])


def test_slurmdbd_down_several_overlaps_loses_no_failure(
    devcluster: DevCluster, work_dir: Path
) -> None:
    outage(devcluster, work_dir, restart=None)


def test_slurmctld_restarted_in_the_outage_loses_no_failure(
    devcluster: DevCluster, work_dir: Path
) -> None:
    outage(devcluster, work_dir, restart="slurmctld")


def test_the_daemon_restarted_in_the_outage_loses_no_failure(
    devcluster: DevCluster, work_dir: Path
) -> None:
    outage(devcluster, work_dir, restart="daemon")
