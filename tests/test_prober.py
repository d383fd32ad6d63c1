"""The probe runner's scheduling (fakes at the fetch seam) and its settings' validation."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from daemon.evidence.prober import NodeProber, ProbeRequest, ProbeSettings, RawProbe
from daemon.evidence.records import ProbeVerdict, XidPolicy
from tests.test_probe import document, tool

NOW = datetime(2026, 11, 22, 3, 30, tzinfo=UTC)


@pytest.fixture
def settings(tmp_path: Path) -> ProbeSettings:
    (tmp_path / "key").write_text("k")
    (tmp_path / "known_hosts").write_text("")
    return ProbeSettings(key_path=tmp_path / "key", known_hosts_path=tmp_path / "known_hosts")


class FakeFetch:
    """Counts fetches per node and how many ran at once."""

    def __init__(self, text: str = document(), delay: float = 0.0) -> None:
        self.text = text
        self.delay = delay
        self.calls: list[str] = []
        self.running = 0
        self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, node: str) -> RawProbe:
        with self.lock:
            self.calls.append(node)
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1
        if node.startswith("down"):
            return RawProbe(node, NOW, None, f"{node}: connection refused (no sshd listening)")
        return RawProbe(node, NOW, self.text)


def test_one_fetch_per_node_however_many_jobs(settings: ProbeSettings) -> None:
    fetch = FakeFetch()
    prober = NodeProber(settings, fetch=fetch, clock=lambda: NOW)
    probes = prober.probe_many(
        [
            ProbeRequest("gpu-01"),
            ProbeRequest("gpu-02"),
            ProbeRequest("gpu-01"),
            ProbeRequest("gpu-01"),
        ]
    )
    assert [probe.node for probe in probes] == ["gpu-01", "gpu-02", "gpu-01", "gpu-01"]
    assert sorted(fetch.calls) == ["gpu-01", "gpu-02"]


def test_cache_serves_within_ttl_and_refetches_after(settings: ProbeSettings) -> None:
    fetch = FakeFetch()
    prober = NodeProber(settings.model_copy(update={"cache_ttl_s": 0.2}), fetch=fetch)
    prober.probe("gpu-01")
    prober.probe("gpu-01")
    assert fetch.calls == ["gpu-01"]
    time.sleep(0.3)
    prober.probe("gpu-01")
    assert fetch.calls == ["gpu-01", "gpu-01"]


def test_a_fresh_probe_fetches_past_the_cache_and_refills_it(settings: ProbeSettings) -> None:
    """A sweep's check is of now; an incident's probe a moment later may reuse it."""
    fetch = FakeFetch()
    prober = NodeProber(settings.model_copy(update={"cache_ttl_s": 3600}), fetch=fetch)
    prober.probe("gpu-01")
    prober.probe_many([ProbeRequest("gpu-01")], fresh=True)
    assert fetch.calls == ["gpu-01", "gpu-01"]
    prober.probe("gpu-01")
    assert fetch.calls == ["gpu-01", "gpu-01"]


def test_concurrency_is_bounded(settings: ProbeSettings) -> None:
    fetch = FakeFetch(delay=0.05)
    prober = NodeProber(settings.model_copy(update={"concurrency": 3}), fetch=fetch)
    prober.probe_many([ProbeRequest(f"gpu-{n:02d}") for n in range(12)])
    assert len(fetch.calls) == 12
    assert fetch.peak == 3


def test_concurrent_callers_share_one_fetch(settings: ProbeSettings) -> None:
    fetch = FakeFetch(delay=0.2)
    prober = NodeProber(settings, fetch=fetch)
    results: list[ProbeVerdict] = []
    threads = [
        threading.Thread(target=lambda: results.append(prober.probe("gpu-07").verdict))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fetch.calls == ["gpu-07"]
    assert results == [ProbeVerdict.HEALTHY] * 4


def test_unreachable_node_is_never_healthy(settings: ProbeSettings) -> None:
    prober = NodeProber(settings, fetch=FakeFetch(), clock=lambda: NOW)
    probe = prober.probe("down-01")
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error == "down-01: connection refused (no sshd listening)"
    assert probe.gpus == ()


def test_a_crashing_fetch_becomes_unreachable(settings: ProbeSettings) -> None:
    def broken(node: str) -> RawProbe:
        raise RuntimeError("bug")

    probe = NodeProber(settings, fetch=broken, clock=lambda: NOW).probe("gpu-01")
    assert (probe.verdict, probe.error) == (ProbeVerdict.UNREACHABLE, "probe failed: bug")


def test_window_is_the_jobs_run_plus_slack(settings: ProbeSettings) -> None:
    inside = (NOW - timedelta(minutes=3)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    text = document(
        kernel_log=tool(f"{inside} NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off\n")
    )
    prober = NodeProber(settings, fetch=FakeFetch(text), clock=lambda: NOW)
    during = prober.probe("gpu-03", start=NOW - timedelta(minutes=10), end=NOW)
    long_before = prober.probe(
        "gpu-03", start=NOW - timedelta(hours=3), end=NOW - timedelta(hours=2)
    )
    assert during.verdict is ProbeVerdict.FAULTY
    assert long_before.verdict is ProbeVerdict.HEALTHY


def test_xid_override_from_settings_changes_the_verdict(settings: ProbeSettings) -> None:
    inside = (NOW - timedelta(minutes=3)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    text = document(kernel_log=tool(f"{inside} NVRM: Xid (PCI:0000:07:00): 13, pid=1, Graphics\n"))
    strict = ProbeSettings.model_validate(
        {**settings.model_dump(), "xid_overrides": {"13": {"policy": "hardware"}}}
    )
    assert strict.catalog().entry(13).policy is XidPolicy.HARDWARE
    probe = NodeProber(strict, fetch=FakeFetch(text), clock=lambda: NOW).probe(
        "gpu-01", start=NOW - timedelta(minutes=5)
    )
    assert probe.verdict is ProbeVerdict.FAULTY


def test_node_names_that_are_not_host_names_are_refused(settings: ProbeSettings) -> None:
    prober = NodeProber(settings, fetch=FakeFetch())
    with pytest.raises(ValueError, match="not a node name"):
        prober.probe("gpu-01; rm -rf /")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"xid_overrides": {"79": {"policy": "drain"}}}, "policy"),
        ({"xid_overrides": {"79": {"count_threshold": 0}}}, "greater than or equal to 1"),
        ({"xid_overrides": {"5000": {"policy": "hardware"}}}, "out of range"),
        ({"xid_overrides": {"300": {"count_threshold": 2}}}, "must set a policy"),
        ({"concurrency": 0}, "greater than or equal to 1"),
        ({"user": "root; id"}, "should match pattern"),
        ({"known_hosts_path": "/nonexistent/known_hosts"}, "is not a readable file"),
        ({"colour": "red"}, "Extra inputs"),
    ],
)
def test_bad_settings_fail_at_start_up(
    settings: ProbeSettings, change: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        ProbeSettings.model_validate({**settings.model_dump(), **change})
