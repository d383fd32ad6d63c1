"""The node probe over real SSH against the local cluster's per-node sshd and fixtures.

Every test leaves the nodes as it found them (healthy fixtures, sshd up, original host
key), through `node_state` and finalizers, because other sessions share the cluster.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from daemon.evidence.prober import NodeProber, ProbeRequest, ProbeSettings
from daemon.evidence.records import ProbeVerdict
from daemon.process import run
from tests.devcluster import DevCluster

pytestmark = pytest.mark.cluster


def settings_for(cluster: DevCluster, **changes: object) -> ProbeSettings:
    values: dict[str, object] = {
        "key_path": cluster.medic_key,
        "known_hosts_path": cluster.known_hosts,
        "user": cluster.service_user,
        "connect_timeout_s": 5,
        "command_timeout_s": 30,
        "cache_ttl_s": 0,
    }
    return ProbeSettings.model_validate({**values, **changes})


def job_window() -> tuple[datetime, datetime]:
    """A job that ran for the last ten minutes, as sacct would give it."""
    end = datetime.now(UTC)
    return end - timedelta(minutes=10), end


@pytest.fixture
def healthy_cluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    """All nodes healthy with sshd up before and after the test, whatever it did."""
    devcluster.set_node_state("all", "healthy")
    yield devcluster
    devcluster.set_node_state("all", "healthy")


def test_each_fixture_node_gets_its_verdict_in_one_fan_out(healthy_cluster: DevCluster) -> None:
    cluster = healthy_cluster
    cluster.set_node_state("gpu-02", "row-remap-pending")
    cluster.set_node_state("gpu-03", "xid79")
    cluster.set_node_state("gpu-04", "cotenant")
    start, end = job_window()
    prober = NodeProber(settings_for(cluster))
    probes = prober.probe_many(
        [ProbeRequest(f"gpu-0{n}", start, end) for n in (1, 2, 3, 4)]
        + [ProbeRequest("gpu-03", start, end)]
    )
    assert prober.fetch_count == 4  # gpu-03 asked twice, fetched once
    verdicts = {probe.node: probe.verdict for probe in probes}
    assert verdicts == {
        "gpu-01": ProbeVerdict.HEALTHY,
        "gpu-02": ProbeVerdict.FAULTY,
        "gpu-03": ProbeVerdict.FAULTY,
        "gpu-04": ProbeVerdict.DEGRADED,
    }
    healthy, remap, xid, cotenant = probes[:4]
    assert len(healthy.gpus) == 8
    assert remap.reasons[0] == (
        "GPU 2 (00000000:47:00.0): row remap pending (1 correctable, 0 uncorrectable rows): "
        "needs a GPU reset"
    )
    (fallen,) = [event for event in xid.xid_events if event.code == 79]
    assert fallen.pci_bus_id == "0000:47:00"
    assert fallen.time is not None
    assert start <= fallen.time <= end
    assert xid.reasons[0] == (
        "XID 79 (GPU has fallen off the bus) x1 on 0000:47:00, threshold 1: hardware"
    )
    assert 13 not in {event.code for event in xid.xid_events}  # a day old: outside the job
    (app,) = cotenant.gpus[3].compute_apps
    assert (app.pid, app.process_name, app.used_bytes) == (31337, "python3", 30 * 1024**3)


def test_node_with_sshd_down_is_unreachable(healthy_cluster: DevCluster) -> None:
    healthy_cluster.node_sshd("gpu-01", "stop")
    try:
        probe = NodeProber(settings_for(healthy_cluster)).probe("gpu-01")
    finally:
        healthy_cluster.node_sshd("gpu-01", "start")
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error == "gpu-01: connection refused (no sshd listening)"
    assert probe.gpus == ()


def test_changed_host_key_is_refused_and_recorded(healthy_cluster: DevCluster) -> None:
    known_hosts_before = healthy_cluster.known_hosts.read_text()
    healthy_cluster.node_sshd("gpu-02", "rekey")
    try:
        probe = NodeProber(settings_for(healthy_cluster)).probe("gpu-02")
    finally:
        healthy_cluster.node_sshd("gpu-02", "restore")
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error is not None
    assert probe.error.startswith("refused: gpu-02: host key changed: known_hosts has ssh-ed25519")
    assert healthy_cluster.known_hosts.read_text() == known_hosts_before
    after = NodeProber(settings_for(healthy_cluster)).probe("gpu-02")
    assert after.verdict is ProbeVerdict.HEALTHY


def test_hanging_probe_times_out(healthy_cluster: DevCluster) -> None:
    with healthy_cluster.node_state("gpu-03", "hang"):
        probe = NodeProber(settings_for(healthy_cluster, command_timeout_s=3)).probe("gpu-03")
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error == "gpu-03: command timed out after 3s"


def test_garbage_output_is_unreadable_not_healthy(healthy_cluster: DevCluster) -> None:
    with healthy_cluster.node_state("gpu-04", "garbage"):
        probe = NodeProber(settings_for(healthy_cluster)).probe("gpu-04")
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.reasons[0] == "gpu-04's GPU state could not be read, so it is not called healthy"
    assert probe.error is not None
    assert probe.error.startswith("gpu_health: line 1 is not nvidia-smi -q output")


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as key=value pairs (22.05 has no --json for scontrol)."""
    line = run(["scontrol", "show", "job", "-o", job_id], timeout=30, check=True).stdout
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def test_xid79_during_a_running_job_on_gpu03(healthy_cluster: DevCluster) -> None:
    user = healthy_cluster.job_users[0]
    job_id = run(
        ["sbatch", f"--uid={user}", f"--gid={user}", "--parsable", "--nodelist=gpu-03",
         "--job-name=medic-probe-xid79", "--output=/dev/null", "--wrap", "sleep 120"],
        timeout=30,
        check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        job = scontrol_job(job_id)
        while job.get("JobState") != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
            job = scontrol_job(job_id)
        assert job["JobState"] == "RUNNING"
        start = datetime.fromisoformat(job["StartTime"]).astimezone(UTC)
        time.sleep(3)  # the rank runs a while before the GPU falls off the bus
        with healthy_cluster.node_state("gpu-03", "xid79"):
            probe = NodeProber(settings_for(healthy_cluster, window_slack_s=0)).probe(
                "gpu-03", start=start
            )
    finally:
        run(["scancel", job_id], timeout=30)
    assert probe.verdict is ProbeVerdict.FAULTY
    (fallen,) = [event for event in probe.xid_events if event.code == 79]
    assert fallen.time is not None
    assert start <= fallen.time <= probe.probed_at
    assert probe.reasons[0].startswith("XID 79 (GPU has fallen off the bus) x1 on 0000:47:00")
