"""The fleet sweep on the local cluster (issue 15): `slurm-medic sweep` over real SSH and the
fixture nodes, the daemon's scheduled sweep draining on policy (at once for a failed remap,
after the running job for a pending one, never past the circuit breaker, which counts an
incident's drain too) and returning a remapped node to service, and an admin's cordon.

Every test leaves the nodes healthy, undrained and free of its jobs, since other tests share
the cluster.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from daemon import process
from daemon.store import control
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import AuditEvent, NodeCheck, NodeEvent, NodeEventKind
from daemon.store.settings import StoreSettings
from tests.devcluster import DevCluster, job_state, sbatch_as
from tests.e2e import USER, Medic, make_work_dir, node_reason
from tests.test_e2e_cluster import probe_settings

pytestmark = pytest.mark.cluster

NODES = "gpu-[01-04]"
ALL = ("gpu-01", "gpu-02", "gpu-03", "gpu-04")
INTERVAL_S = 10
ADMIN = "bob"  # a member of the admin group below (his own group), unlike alice


def _undrain(node: str) -> None:
    """Slurm refuses RESUME on a node that is not drained; that refusal is fine here."""
    done = process.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=30)
    assert done.ok or "Invalid node state" in done.stderr, done.stderr


def _in_service(node: str) -> bool:
    """Idle with no reason; slurmctld may briefly mark a busy machine's node not responding
    (`IDLE*`), which is not what these tests are about."""
    state, reason = node_reason(node)
    return state.rstrip("*") == "IDLE" and reason == ""


@pytest.fixture
def clean_nodes(devcluster: DevCluster) -> Iterator[DevCluster]:
    """Every node healthy and undrained before and after the test, whatever it did."""
    devcluster.set_node_state("all", "healthy")
    yield devcluster
    for node in ALL:
        _undrain(node)
    devcluster.set_node_state("all", "healthy")


@pytest.fixture
def medic_for(clean_nodes: DevCluster) -> Iterator[list[Medic]]:
    """Medics the test makes (config sections of its own); stopped and removed afterwards."""
    made: list[Medic] = []
    yield made
    for medic in made:
        if medic.alive():
            medic.stop()
        medic.dispose()


def _medic(cluster: DevCluster, made: list[Medic], extra_config: str) -> Medic:
    medic = Medic(make_work_dir("medic-sweep"), probe_settings(cluster), extra_config=extra_config)
    medic.prepare()
    made.append(medic)
    return medic


def _checks(medic: Medic, node: str) -> list[NodeCheck]:
    with medic.session() as session:
        query = select(NodeCheck).where(NodeCheck.node == node).order_by(NodeCheck.id)
        return list(session.scalars(query))


def _events(medic: Medic, node: str) -> list[NodeEvent]:
    with medic.session() as session:
        query = select(NodeEvent).where(NodeEvent.node == node).order_by(NodeEvent.id)
        return list(session.scalars(query))


def test_sweep_names_each_node_with_its_deciding_fact(
    clean_nodes: DevCluster, medic_for: list[Medic]
) -> None:
    cluster = clean_nodes
    cluster.set_node_state("gpu-02", "row-remap-pending")
    cluster.set_node_state("gpu-03", "gpu-missing")
    cluster.set_node_state("gpu-04", "cotenant")
    medic = _medic(cluster, medic_for, "")

    done = medic.cli("sweep", NODES, "--json", check=False)

    assert done.returncode == 1, done.stderr  # a faulty node
    shown = {row["node"]: row for row in json.loads(done.stdout)["nodes"]}
    assert {node: row["health"] for node, row in shown.items()} == {
        "gpu-01": "healthy",
        "gpu-02": "faulty",
        "gpu-03": "faulty",
        "gpu-04": "degraded",
    }
    assert shown["gpu-02"]["deciding"].startswith("GPU 2 (00000000:47:00.0): row remap pending")
    assert "pid 31337 (python3) holds 30" in shown["gpu-04"]["deciding"]
    assert "outside any job" in shown["gpu-04"]["deciding"]
    assert shown["gpu-01"]["gpus_seen"] == shown["gpu-01"]["gpus_expected"] == 8
    assert shown["gpu-03"]["deciding"].startswith(
        "Slurm's gres promises 8 GPUs, nvidia-smi lists 7: 1 missing"
    )
    # Asked only to look: what policy would do is said and recorded, nothing is drained.
    assert shown["gpu-02"]["decision"] == "held"
    assert "would drain_after_job" in shown["gpu-02"]["decision_reason"]
    assert "DRAIN" not in node_reason("gpu-02")[0]
    assert [check.health for check in _checks(medic, "gpu-02")] == ["faulty"]

    text = medic.cli("sweep", NODES, check=False).stdout
    (line,) = [line for line in text.splitlines() if "gpu-02" in line]
    assert "faulty" in line
    assert "row remap pending" in line
    assert "1 healthy, 1 degraded, 2 faulty, 0 unreachable" in text

    refused = medic.cli("sweep", NODES, as_user=USER, check=False)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert len(_checks(medic, "gpu-02")) == 2  # alice's sweep probed nothing


def test_the_daemons_sweep_drains_on_policy_waits_for_the_job_and_stops_at_the_breaker(
    clean_nodes: DevCluster, medic_for: list[Medic]
) -> None:
    cluster = clean_nodes
    medic = _medic(
        cluster,
        medic_for,
        "[policy]\nmax_drains_per_hour = 3\n"
        f'[sweep]\nenabled = true\ninterval_s = {INTERVAL_S}\nnodes = "{NODES}"\n'
        "auto_resume = true\nresume_after_healthy = 2\n",
    )
    # An incident drained gpu-01 a few minutes ago, as the pipeline does: Slurm and the record.
    incident_reason = "medic: incident 7 (hardware) job 1234"
    process.run(
        ["scontrol", "update", "NodeName=gpu-01", "State=DRAIN", f"Reason={incident_reason}"],
        timeout=30,
        check=True,
    )
    engine = make_engine(StoreSettings(url=medic.url))
    with make_session_factory(engine)() as session:
        control.record_node_event(
            session, node="gpu-01", kind=NodeEventKind.DRAIN, by_medic=True, reason=incident_reason
        )
        session.commit()
    engine.dispose()
    with tempfile.TemporaryDirectory(prefix="medic-sweep-job-") as scratch:
        job_dir = Path(scratch)
        job_dir.chmod(0o777)
        script = job_dir / "sleep.sbatch"
        script.write_text("#!/bin/bash\n#SBATCH --nodelist=gpu-02\n#SBATCH --mem=100M\nsleep 600\n")
        job = sbatch_as(USER, job_dir, "sweep-busy", script)
        try:
            medic.wait_for("the busy job running", lambda: job_state(job) == "RUNNING", 60)
            medic.start()
            medic.wait_for(
                "a first check of every node",
                lambda: all(_checks(medic, node) for node in ALL),
                3 * INTERVAL_S,
            )
            cluster.set_node_state("gpu-03", "remap-failure")
            cluster.set_node_state("gpu-02", "row-remap-pending")

            # Within an interval: a failed remap drains at once, a pending one lets the job run.
            medic.wait_for(
                "gpu-03 drained by the sweep",
                lambda: "DRAIN" in node_reason("gpu-03")[0],
                2 * INTERVAL_S + 10,
            )
            reason = node_reason("gpu-03")[1]
            assert reason.startswith("medic: sweep: GPU 5"), reason
            assert "row remapping failure" in reason
            medic.wait_for(
                "gpu-02 draining behind its job",
                lambda: node_reason("gpu-02")[0].startswith("DRAINING"),
                2 * INTERVAL_S + 10,
            )
            assert job_state(job) == "RUNNING"
            (drain,) = [e for e in _events(medic, "gpu-02") if e.kind == "drain"]
            assert (drain.actor_name, drain.finding) == ("slurm-medic", "remap_pending")
            drain_check = next(c for c in _checks(medic, "gpu-02") if c.id == drain.check_id)
            assert drain_check.decision == "drain_after_job"
            assert drain_check.running_jobs == [int(job)]

            # The incident's drain and the sweep's two spent the hour's three.
            cluster.set_node_state("gpu-04", "ecc-uncorrectable")
            held = medic.wait_for(
                "gpu-04 held by the breaker",
                lambda: [c for c in _checks(medic, "gpu-04") if c.decision == "held"],
                2 * INTERVAL_S + 10,
            )
            assert "drain circuit breaker: 3 drain(s) in the last hour" in held[0].decision_reason
            assert "DRAIN" not in node_reason("gpu-04")[0]
        finally:
            process.run(["scancel", job], timeout=30)

    # The job's end brings a check of its node; the node is then drained, idle.
    after = medic.wait_for(
        "a check of gpu-02 after its job",
        lambda: [c for c in _checks(medic, "gpu-02") if c.after_job_id == int(job)],
        3 * INTERVAL_S,
    )
    assert after[0].trigger == "after_job"
    medic.wait_for("gpu-02 drained", lambda: node_reason("gpu-02")[0].rstrip("*") == "DRAINED", 30)

    # A reset applied the remap: two healthy sweeps in a row, and policy allows it.
    cluster.set_node_state("gpu-02", "healthy")
    medic.wait_for("gpu-02 back in service", lambda: _in_service("gpu-02"), 4 * INTERVAL_S + 10)
    resumed = [e for e in _events(medic, "gpu-02") if e.kind == "resume"]
    assert resumed[0].actor_name == "slurm-medic"
    assert "2 sweeps in a row found the node healthy" in resumed[0].reason
    # A failed remap and the incident's drain are never lifted by the sweep.
    assert "DRAIN" in node_reason("gpu-03")[0]
    assert node_reason("gpu-01")[1] == incident_reason
    assert _checks(medic, "gpu-03")[-1].decision == "keep_drained"


def test_an_admins_cordon_is_on_the_record_and_a_non_admins_is_refused(
    clean_nodes: DevCluster, medic_for: list[Medic]
) -> None:
    medic = _medic(clean_nodes, medic_for, f'[policy]\nadmin_groups = ["{ADMIN}"]\n')

    refused = medic.cli(
        "nodes", "drain", "gpu-04", "--reason", "fan noise", as_user=USER, check=False
    )
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "DRAIN" not in node_reason("gpu-04")[0]
    with medic.session() as session:
        verbs = session.scalars(select(AuditEvent.verb).where(AuditEvent.actor_name == USER)).all()
    assert "node_drain_refused" in verbs

    medic.cli("nodes", "drain", "gpu-04", "--reason", "fan noise", as_user=ADMIN)
    state, reason = node_reason("gpu-04")
    assert "DRAIN" in state
    assert reason == f"medic: cordon by {ADMIN}: fan noise"
    (event,) = _events(medic, "gpu-04")
    assert (event.kind, event.actor_name, event.finding) == ("drain", ADMIN, "cordon")
    (check,) = _checks(medic, "gpu-04")
    assert (check.id, check.trigger, check.health) == (event.check_id, "cordon", "healthy")

    listed = json.loads(medic.cli("nodes", "--json").stdout)
    (row,) = [row for row in listed["nodes"] if row["node"] == "gpu-04"]
    assert row["drain"]["by"] == ADMIN

    story = medic.cli("show", "gpu-04").stdout
    assert "cordon" in story
    assert "fan noise" in story

    medic.cli("nodes", "resume", "gpu-04", "--why", "fan replaced", as_user=ADMIN)
    medic.wait_for("gpu-04 back in service", lambda: _in_service("gpu-04"), 30)
    assert [e.kind for e in _events(medic, "gpu-04")] == ["drain", "resume"]
