"""Crash tests: a real `slurm-medic run` SIGKILLed at each stage of acting, then restarted.

The moment is widened with a real seam, not a fake: the daemon's PATH starts with a
wrapper `sbatch` or `scontrol` that, the first time only, pauses before or after calling
the real tool and leaves a marker; the test watches for the marker (or for the record's
state) and kills the daemon's whole process group, as systemd ends a crashed unit. A new
daemon then starts on the same record. Slurm is the judge: the jobs carrying the
scenario's name are counted in accounting, and the lineage must still reach its outcome.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import select

from daemon import process
from daemon.slurm.records import MEDIC_REASON_PREFIX
from daemon.store.models import Action
from tests.devcluster import DevCluster
from tests.e2e import (
    FINAL_PROPOSAL_STATES,
    Medic,
    Scenario,
    jobs_with_token,
    make_template,
    make_work_dir,
    node_list,
    node_reason,
)
from tests.test_e2e_cluster import probe_settings

pytestmark = [pytest.mark.cluster]

SICK_NODE = "gpu-03"
PAUSE_S = 60
OUTCOME_TIMEOUT_S = 120
# One shell script serves every stage: WRAP_WHEN says whether the first matching call
# pauses before the real tool runs or after it answered (its answer held back meanwhile).
WRAPPER = """#!/bin/bash
real={real}
marks={marks}
if {matches} && mkdir "$marks/taken" 2>/dev/null; then
    if [ {when} = before ]; then
        touch "$marks/paused"
        sleep {pause}
        exec "$real" "$@"
    fi
    answer=$("$real" "$@"); status=$?
    printf '%s\\n' "$answer" >"$marks/answered"
    touch "$marks/paused"
    sleep {pause}
    printf '%s\\n' "$answer"
    exit $status
fi
exec "$real" "$@"
"""


@dataclass(frozen=True)
class Stage:
    name: str
    tool: str
    when: str
    # A shell test on "$@": which call of the tool is the one to pause.
    matches: str = "true"


AFTER_INTENT = Stage("after-intent", "sbatch", "before")
AFTER_SBATCH = Stage("after-sbatch", "sbatch", "after")
DURING_DRAIN = Stage("during-drain", "scontrol", "after", '[[ "$*" == *State=DRAIN* ]]')


def install_wrapper(work_dir: Path, stage: Stage) -> tuple[dict[str, str], Path]:
    """The daemon's PATH with the wrapper first, and the folder its markers appear in."""
    bin_dir = work_dir / "bin"
    marks = work_dir / "marks"
    bin_dir.mkdir()
    marks.mkdir()
    wrapper = bin_dir / stage.tool
    wrapper.write_text(
        WRAPPER.format(
            real=f"/usr/bin/{stage.tool}",
            marks=marks,
            matches=stage.matches,
            when=stage.when,
            pause=PAUSE_S,
        ),
        encoding="utf-8",
    )
    wrapper.chmod(0o755)
    # sbatch runs as the job's owner (setpriv), and so does its wrapper: it marks here too.
    marks.chmod(0o777)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, marks


@pytest.fixture
def work_dir() -> Path:
    return make_work_dir("medic-crash")


def unique(work_dir: Path, stage: str) -> str:
    """A job name no earlier run used, so counting jobs by name counts this run's only."""
    return f"crash-{stage}-{work_dir.name.rsplit('-', 1)[-1]}"


def jobs_named(name: str) -> list[int]:
    """Every job of this scenario that Slurm knows, whoever submitted it."""
    done = process.run(
        ["sacct", "-X", "-n", "-P", "-a", "-S", "now-30minutes", "-o", "JobID,JobName"],
        timeout=30,
        check=True,
    )
    found = {
        int(job)
        for job, _, job_name in (line.partition("|") for line in done.stdout.splitlines())
        if job_name == name and job.isdigit()
    }
    return sorted(found)


def outcome(medic: Medic, lineage: int) -> str:
    proposal = medic.wait_for(
        "an outcome after the restart",
        partial(medic.proposal_in, lineage, FINAL_PROPOSAL_STATES),
        OUTCOME_TIMEOUT_S,
    )
    return proposal.state


def check_exactly_once(medic: Medic, lineage: int, first_job: int, name: str) -> int:
    """One incident, one relaunch in Slurm, each token on one job at most; the relaunch."""
    incidents = medic.incidents(lineage)
    assert [incident.slurm_job_id for incident in incidents] == [first_job]
    proposals = medic.proposals(lineage)
    assert len(proposals) == 1
    relaunch = proposals[0].relaunch_job_id
    assert relaunch is not None
    assert jobs_named(f"e2e-{name}") == [first_job, relaunch]
    with medic.session() as session:
        sbatch = list(session.scalars(select(Action).where(Action.kind == "sbatch")))
    for action in sbatch:
        assert len(jobs_with_token(action.token)) <= 1, action.token
    # The first submission is an sbatch action too, made by `slurm-medic submit`.
    assert sorted(a.slurm_job_id or 0 for a in sbatch if a.result == "succeeded") == [
        first_job,
        relaunch,
    ]
    return relaunch


@pytest.mark.parametrize("stage", [AFTER_INTENT, AFTER_SBATCH], ids=lambda stage: stage.name)
def test_killed_around_sbatch_relaunches_once(
    devcluster: DevCluster, work_dir: Path, stage: Stage
) -> None:
    name = unique(work_dir, stage.name)
    env, marks = install_wrapper(work_dir, stage)
    medic = Medic(work_dir, probe_settings(devcluster), daemon_env=env)
    medic.prepare()
    lineage, first_job, _token = medic.submit(
        make_template(work_dir, Scenario(name, "torchrun", "fragmentation", one_rank_per_node=True))
    )
    medic.start()
    try:
        medic.wait_for(f"{stage.tool} paused", (marks / "paused").exists, OUTCOME_TIMEOUT_S)
        intent = medic.wait_for("the intent on the record", partial(pending_sbatch, medic), 10)
        assert medic.kill() == -9
        in_slurm = jobs_with_token(intent.token)
        assert len(in_slurm) == (1 if stage is AFTER_SBATCH else 0)

        medic.start()
        assert outcome(medic, lineage) == "verified", medic.tail()
        relaunch = check_exactly_once(medic, lineage, first_job, name)
        with medic.session() as session:
            first = session.get(Action, intent.id)
        assert first is not None
        if stage is AFTER_SBATCH:
            # The job sbatch made before the crash is the relaunch, found by its token.
            assert in_slurm == [relaunch]
            assert first.result == "succeeded"
        else:
            assert first.result == "not_found"
    finally:
        if medic.alive():
            medic.stop()
        medic.dispose()


def pending_sbatch(medic: Medic) -> Action | None:
    with medic.session() as session:
        return session.scalars(
            select(Action).where(Action.kind == "sbatch", Action.result == "pending")
        ).first()


def test_killed_during_a_drain_drains_once_and_relaunches_once(
    devcluster: DevCluster, work_dir: Path
) -> None:
    name = unique(work_dir, "during-drain")
    env, marks = install_wrapper(work_dir, DURING_DRAIN)
    medic = Medic(work_dir, probe_settings(devcluster), daemon_env=env)
    medic.prepare()
    scenario = Scenario(name, "torchrun", "faulty-node", {"nodes": "3"}, one_rank_per_node=True)
    try:
        with devcluster.node_state(SICK_NODE, "xid79"):
            lineage, first_job, _token = medic.submit(make_template(work_dir, scenario))
            medic.start()
            medic.wait_for("the drain paused", (marks / "paused").exists, OUTCOME_TIMEOUT_S)
            state, reason = node_reason(SICK_NODE)
            assert "DRAIN" in state
            assert reason.startswith(MEDIC_REASON_PREFIX)
            assert medic.kill() == -9
            medic.start()
            assert outcome(medic, lineage) == "verified", medic.tail()
        relaunch = check_exactly_once(medic, lineage, first_job, name)
        assert SICK_NODE in node_list(first_job)
        assert SICK_NODE not in node_list(relaunch)
        state, reason = node_reason(SICK_NODE)
        assert "DRAIN" in state
        assert reason.startswith(MEDIC_REASON_PREFIX)
    finally:
        if medic.alive():
            medic.stop()
        if node_reason(SICK_NODE)[1].startswith(MEDIC_REASON_PREFIX):
            medic.cli("nodes", "resume", SICK_NODE)
        medic.dispose()


def test_killed_during_verification_still_verifies(devcluster: DevCluster, work_dir: Path) -> None:
    name = unique(work_dir, "verifying")
    medic = Medic(work_dir, probe_settings(devcluster))
    medic.prepare()
    lineage, first_job, _token = medic.submit(
        make_template(work_dir, Scenario(name, "torchrun", "fragmentation", one_rank_per_node=True))
    )
    medic.start()
    try:
        medic.wait_for(
            "the relaunch being followed",
            partial(medic.proposal_in, lineage, ("submitted", "verifying")),
            OUTCOME_TIMEOUT_S,
            every_s=0.1,
        )
        assert medic.kill() == -9
        time.sleep(1)
        medic.start()
        assert outcome(medic, lineage) == "verified", medic.tail()
        check_exactly_once(medic, lineage, first_job, name)
    finally:
        if medic.alive():
            medic.stop()
        medic.dispose()
