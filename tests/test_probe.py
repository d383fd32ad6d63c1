"""The probe document -> NodeProbe verdicts, on literal documents and on the real probe
program run locally against each dev-cluster node state."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.evidence.kernel_log import TimeWindow
from daemon.evidence.probe import interpret_probe, parse_document
from daemon.evidence.records import NodeProbe, ProbeVerdict, XidPolicy
from daemon.evidence.xid import XidCatalog, XidOverride, load_catalog

REPO = Path(__file__).parent.parent
PROBE = REPO / "daemon" / "installable" / "node_probe.py"
STATES = REPO / "deploy" / "devcluster" / "node-states"
NOW = datetime(2026, 11, 22, 3, 30, tzinfo=UTC)
WINDOW = TimeWindow(NOW - timedelta(minutes=20), NOW)
CATALOG = load_catalog()
HEALTHY_Q = (
    "GPU 00000000:07:00.0\n"
    "    ECC Errors\n"
    "        Volatile\n"
    "            DRAM Correctable              : 0\n"
    "            DRAM Uncorrectable            : 0\n"
    "    Remapped Rows\n"
    "        Correctable Error                 : 0\n"
    "        Uncorrectable Error               : 0\n"
    "        Pending                           : No\n"
    "        Remapping Failure Occurred        : No\n"
)
ROW = "0, GPU-a, 00000000:07:00.0, 81920 MiB, 0 MiB\n"


def tool(stdout: str = "", exit_code: int = 0, **extra: object) -> dict[str, object]:
    return {"argv": ["x"], "exit_code": exit_code, "stdout": stdout, "stderr": "", **extra}


def document(**tools: dict[str, object]) -> str:
    base = {
        "kernel_log": tool(""),
        "gpu_health": tool(HEALTHY_Q),
        "gpus": tool(ROW),
        "compute_apps": tool(""),
    }
    base.update(tools)
    return json.dumps({"format": "medic-node-probe/1", "hostname": "h", "tools": base})


def interpret(text: str, catalog: XidCatalog = CATALOG) -> NodeProbe:
    """The verdict on a probe document from gpu-09, probed at NOW, looking back over WINDOW."""
    return interpret_probe("gpu-09", text, probed_at=NOW, catalog=catalog, window=WINDOW)


def test_clean_node_is_healthy_with_a_reason() -> None:
    probe = interpret(document())
    assert probe.verdict is ProbeVerdict.HEALTHY
    assert probe.reasons[0].startswith("1 GPUs: no pending or failed row remap")
    (gpu,) = probe.gpus
    assert (gpu.uuid, gpu.memory_total_bytes, gpu.remap_pending) == ("GPU-a", 81920 << 20, False)


def test_hardware_xid_in_window_is_faulty_and_outside_is_ignored() -> None:
    inside = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    outside = (NOW - timedelta(hours=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    log = (
        f"{outside} NVRM: Xid (PCI:0000:07:00): 48, pid=1, DBE\n"
        f"{inside} NVRM: Xid (PCI:0000:07:00): 79, pid=2, GPU has fallen off the bus.\n"
    )
    probe = interpret(document(kernel_log=tool(log)))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert [event.code for event in probe.xid_events] == [79]
    assert probe.reasons[0] == (
        "XID 79 (GPU has fallen off the bus) x1 on 0000:07:00, threshold 1: hardware"
    )


def test_operator_override_turns_a_hardware_xid_into_nothing() -> None:
    inside = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    log = f"{inside} NVRM: Xid (PCI:0000:07:00): 79, pid=2, GPU has fallen off the bus.\n"
    relaxed = load_catalog({79: XidOverride(policy=XidPolicy.IGNORE)})
    probe = interpret(document(kernel_log=tool(log)), catalog=relaxed)
    assert probe.verdict is ProbeVerdict.HEALTHY


def test_threshold_counts_events_in_window() -> None:
    inside = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    one = f"{inside} NVRM: Xid (PCI:0000:07:00): 63, pid=2, Row Remapper: New row marked\n"
    probe = interpret(document(kernel_log=tool(one)))
    assert probe.verdict is ProbeVerdict.HEALTHY
    assert "below threshold 2" in probe.reasons[-1]
    two = interpret(document(kernel_log=tool(one * 2)))
    assert two.verdict is ProbeVerdict.FAULTY


def test_uncorrectable_volatile_ecc_is_faulty() -> None:
    q = HEALTHY_Q.replace("DRAM Uncorrectable            : 0", "DRAM Uncorrectable            : 2")
    probe = interpret(document(gpu_health=tool(q)))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == (
        "GPU 0 (00000000:07:00.0): 2 uncorrectable ECC errors since the driver loaded",
    )


def test_remap_failure_is_faulty() -> None:
    q = HEALTHY_Q.replace(
        "Remapping Failure Occurred        : No", "Remapping Failure Occurred        : Yes"
    )
    probe = interpret(document(gpu_health=tool(q)))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == ("GPU 0 (00000000:07:00.0): row remapping failure occurred",)


def test_small_process_is_not_a_cotenant_but_a_zombie_with_memory_is() -> None:
    apps = "GPU-a, 10, Xorg, 4 MiB\nGPU-a, 11, [Not Found], 2048 MiB\n"
    probe = interpret(document(compute_apps=tool(apps)))
    assert probe.verdict is ProbeVerdict.DEGRADED
    assert probe.reasons == (
        "GPU 0 (00000000:07:00.0): pid 11 (no name: a zombie or another namespace) holds 2.0 GiB",
    )


def test_host_oom_kill_is_reported_without_changing_verdict() -> None:
    inside = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    log = f"{inside} Memory cgroup out of memory: Killed process 77 (python3) total-vm:1kB\n"
    probe = interpret(document(kernel_log=tool(log)))
    assert probe.verdict is ProbeVerdict.HEALTHY
    assert probe.host_oom_kills[0].pid == 77
    assert "killed pid 77 (python3) in the window: a memory cgroup's limit" in probe.reasons[-1]


def test_timed_out_tool_makes_the_node_unreadable_never_healthy() -> None:
    probe = interpret(document(gpu_health=tool("", exit_code=-9, timed_out=True)))
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error == "gpu_health: timed out on the node"


def test_hardware_evidence_wins_over_a_broken_tool() -> None:
    inside = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    log = f"{inside} NVRM: Xid (PCI:0000:07:00): 79, pid=2, GPU has fallen off the bus.\n"
    probe = interpret(document(kernel_log=tool(log), gpu_health=tool("", exit_code=15)))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert "could not read gpu_health: exit 15" in probe.reasons


@pytest.mark.parametrize(
    "text", ["", "\x89\x00garbage", "[]", '{"format": "other"}', '{"format": "medic-node-probe/1"}']
)
def test_unreadable_documents_are_unreachable_with_error(text: str) -> None:
    probe = interpret(text)
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error is not None
    assert probe.error.startswith("unreadable probe output")


def run_probe_program(state: str) -> str:
    env = {
        "PATH": f"{REPO / 'deploy' / 'devcluster' / 'fixture-bin'}:/usr/bin:/bin",
        "MEDIC_FIXTURE_DIR": str(STATES / state),
        "SSH_ORIGINAL_COMMAND": "rm -rf /",
    }
    result = subprocess.run(
        [sys.executable, str(PROBE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


@pytest.mark.parametrize(
    ("state", "verdict", "first_reason"),
    [
        ("healthy", ProbeVerdict.HEALTHY, "8 GPUs: no pending or failed row remap"),
        ("row-remap-pending", ProbeVerdict.FAULTY, "GPU 2 (00000000:47:00.0): row remap pending"),
        ("xid79", ProbeVerdict.FAULTY, "XID 79 (GPU has fallen off the bus) x1 on 0000:47:00"),
        (
            "cotenant",
            ProbeVerdict.DEGRADED,
            "GPU 3 (00000000:4E:00.0): pid 31337 (python3) holds 30.0 GiB",
        ),
        ("garbage", ProbeVerdict.UNREACHABLE, "gpu-09's GPU state could not be read"),
    ],
)
def test_probe_program_on_each_node_state(
    state: str, verdict: ProbeVerdict, first_reason: str
) -> None:
    now = datetime.now(UTC)
    probe = interpret_probe(
        "gpu-09",
        run_probe_program(state),
        probed_at=now,
        catalog=CATALOG,
        window=TimeWindow(now - timedelta(minutes=10), now),
    )
    assert probe.verdict is verdict
    assert probe.reasons[0].startswith(first_reason)


def test_probe_program_ignores_the_client_command_and_reports_every_tool() -> None:
    parsed = parse_document(run_probe_program("healthy"))
    assert set(parsed.tools) == {"kernel_log", "gpu_health", "gpus", "compute_apps"}
    assert all(output.exit_code == 0 for output in parsed.tools.values())


def test_xid45_after_a_death_is_a_note_not_a_fault() -> None:
    inside = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")
    log = f"{inside} NVRM: Xid (PCI:0000:07:00): 45, pid=9, name=python3, Ch 00000008\n" * 3
    probe = interpret(document(kernel_log=tool(log)))
    assert probe.verdict is ProbeVerdict.HEALTHY
    assert probe.reasons[-1].endswith("x3 on 0000:07:00: cleanup after a process died, not a cause")


def test_no_gpus_listed_is_not_healthy() -> None:
    probe = interpret(document(gpu_health=tool("\n==NVSMI LOG==\n"), gpus=tool("")))
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error == "nvidia-smi listed no GPUs"


def test_truncated_kernel_log_is_said() -> None:
    probe = interpret(document(kernel_log=tool("", truncated=True)))
    assert probe.reasons[-1] == "the kernel log was cut to its newest part on the node"


@given(st.text(max_size=300), st.text(max_size=300), st.text(max_size=300), st.text(max_size=300))
def test_any_tool_output_gives_a_verdict_and_healthy_needs_gpus(
    kernel: str, health: str, gpus: str, apps: str
) -> None:
    text = document(
        kernel_log=tool(kernel), gpu_health=tool(health), gpus=tool(gpus), compute_apps=tool(apps)
    )
    probe = interpret(text)
    assert probe.reasons
    if probe.verdict is ProbeVerdict.HEALTHY:
        assert probe.gpus
    if probe.verdict is ProbeVerdict.UNREACHABLE:
        assert probe.error


@given(st.text(max_size=200))
def test_any_text_that_is_not_a_document_is_unreachable(text: str) -> None:
    probe = interpret(text)
    assert probe.verdict is ProbeVerdict.UNREACHABLE


def test_probe_program_kills_a_hanging_tool_and_still_answers() -> None:
    started = time.monotonic()
    text = run_probe_program("hang")
    assert time.monotonic() - started < 40
    parsed = parse_document(text)
    assert parsed.tools["gpu_health"].timed_out
    assert parsed.tools["gpus"].timed_out
    probe = interpret(text)
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error is not None
    assert "gpu_health: timed out on the node" in probe.error
    assert not processes_with_env(f"MEDIC_FIXTURE_DIR={STATES / 'hang'}")


def processes_with_env(entry: str) -> list[int]:
    """Pids whose environment holds `entry`: what the probe left running, if anything."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.encode() in environ:
            found.append(int(proc.name))
    return found
