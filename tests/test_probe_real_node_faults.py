"""Real published nvidia-smi and kernel-log outputs of faulty GPUs, read by the parsers and
judged by `interpret_probe`; and the dev cluster's fault states, run through the real probe
program, as the fleet sweep will see them."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path

import pytest

from daemon.config import SweepSettings
from daemon.evidence.kernel_log import TimeWindow, parse_kernel_log
from daemon.evidence.nvidia_smi import (
    MIB,
    NvidiaSmiParseError,
    UnreachableGpu,
    find_unreachable_gpus,
    parse_compute_apps,
    parse_gpu_rows,
    parse_query,
)
from daemon.evidence.probe import interpret_probe, parse_document
from daemon.evidence.records import FindingKind, NodeProbe, ProbeVerdict, XidPolicy
from daemon.evidence.xid import load_catalog
from daemon.fleet.findings import judge_node

REPO = Path(__file__).parent.parent
SMI = REPO / "tests" / "data" / "nvidia-smi"
DMESG = REPO / "tests" / "data" / "dmesg"
PROBE = REPO / "daemon" / "installable" / "node_probe.py"
STATES = REPO / "deploy" / "devcluster" / "node-states"
CATALOG = load_catalog()
NOW = datetime(2026, 11, 22, 3, 30, tzinfo=UTC)
# A GPU with nothing wrong, for the documents whose fault is in the kernel log only.
CLEAN_Q = (
    "GPU 00000000:07:00.0\n"
    "    ECC Errors\n"
    "        Volatile\n"
    "            DRAM Correctable              : 0\n"
    "            DRAM Uncorrectable            : 0\n"
    "    Remapped Rows\n"
    "        Pending                           : No\n"
    "        Remapping Failure Occurred        : No\n"
)
CLEAN_ROW = "0, GPU-a, 00000000:07:00.0, 81920 MiB, 0 MiB\n"


def tool(stdout: str, exit_code: int = 0) -> dict[str, object]:
    return {"argv": ["x"], "exit_code": exit_code, "stdout": stdout, "stderr": ""}


def document(
    *, kernel_log: str = "", gpu_health: str = CLEAN_Q, gpus: str = CLEAN_ROW, apps: str = ""
) -> str:
    """A probe document as medic-node-probe prints it, with these tool outputs."""
    tools = {
        "kernel_log": tool(kernel_log),
        "gpu_health": tool(gpu_health),
        "gpus": tool(gpus),
        "compute_apps": tool(apps),
    }
    return json.dumps({"format": "medic-node-probe/1", "hostname": "h", "tools": tools})


def interpret(text: str, window: TimeWindow | None = None) -> NodeProbe:
    return interpret_probe("gpu-09", text, probed_at=NOW, catalog=CATALOG, window=window)


# --- nvidia-smi -q of a GPU with an uncorrectable remapped row --------------------------------


def test_gh200_full_q_reads_its_one_uncorrectable_remapped_row() -> None:
    (gpu,) = parse_query((SMI / "gh200-550-uncorrectable-remapped-row.txt").read_text())
    assert gpu.pci_bus_id == "00000000:DD:00.0"
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (0, 1)
    assert (gpu.remap_pending, gpu.remap_failure_occurred) == (False, False)
    assert (gpu.ecc_volatile_correctable, gpu.ecc_volatile_uncorrectable) == (0, 0)
    assert (gpu.ecc_aggregate_correctable, gpu.ecc_aggregate_uncorrectable) == (0, 1)
    assert gpu.retired_pages_single_bit is None


# The sample's own UUID, bus id and memory, as --query-gpu prints them for that GPU.
GH200_ROW = "0, GPU-35d58415-1094-5ad1-64d1-b797587d33a7, 00000000:DD:00.0, 97871 MiB, 2 MiB\n"


def test_gh200_lifetime_uncorrectable_error_is_degraded_not_faulty() -> None:
    """Remapped and reset since: the GPU runs clean now, so it is watched, not drained."""
    probe = interpret(
        document(
            gpu_health=(SMI / "gh200-550-uncorrectable-remapped-row.txt").read_text(),
            gpus=GH200_ROW,
        )
    )
    assert probe.verdict is ProbeVerdict.DEGRADED
    assert probe.reasons == (
        "GPU 0 (00000000:DD:00.0): 1 uncorrectable ECC errors in its lifetime",
    )
    (gpu,) = probe.gpus
    assert gpu.memory_total_bytes == 97871 * MIB


def test_a100_remapped_rows_block_reads_fourteen_uncorrectable_rows() -> None:
    """The published block is the `Remapped Rows` section alone; nvidia-smi prints it four
    spaces in, under the GPU's header (the report names GPU 1 as bus 0000:46:00.0)."""
    block = (SMI / "a100-580-remapped-rows-uncorrectable.txt").read_text()
    indented = "".join(f"    {line}" for line in block.splitlines(keepends=True))
    (gpu,) = parse_query(f"GPU 00000000:46:00.0\n{indented}")
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (0, 14)
    assert (gpu.remap_pending, gpu.remap_failure_occurred) == (False, False)
    assert gpu.ecc_volatile_uncorrectable is None  # the ECC section was not published


# --- a GPU nvidia-smi cannot reach ------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "unreachable"),
    [
        ("device-handle-unknown-error.txt", UnreachableGpu(None, "0000:09:00.0", "Unknown Error")),
        (
            "device-handle-gpu-lost.txt",
            UnreachableGpu(
                None, "0000:02:00.0", "GPU is lost. Reboot the system to recover this GPU"
            ),
        ),
        (
            "rtx-pro-6000-610-gpu1-unknown-error.txt",
            UnreachableGpu(1, "0000:34:00.0", "Unknown Error"),
        ),
    ],
)
def test_unreachable_gpu_is_named_by_every_parser(sample: str, unreachable: UnreachableGpu) -> None:
    text = (SMI / sample).read_text()
    assert find_unreachable_gpus(text) == (unreachable,)
    expected = f"nvidia-smi cannot reach {unreachable.describe()}: {unreachable.reason}"
    for parse in (parse_query, parse_gpu_rows, parse_compute_apps):
        with pytest.raises(NvidiaSmiParseError, match="cannot reach") as raised:
            parse(text)
        assert str(raised.value) == f"line 1: {expected}"


def test_a_gpu_nvidia_smi_cannot_reach_makes_the_node_faulty_with_the_gpu_named() -> None:
    """Lost to the driver is a fault of the node, not a probe that failed: the rest of the
    GPU state is unread, and said so, but the node is not merely unreachable."""
    line = (SMI / "device-handle-unknown-error.txt").read_text()
    probe = interpret(document(gpu_health=line, gpus=line))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.lost_gpus == ("GPU 0000:09:00.0: Unknown Error",)
    assert probe.reasons[0] == (
        "nvidia-smi cannot reach GPU 0000:09:00.0: Unknown Error: lost to the driver"
    )
    assert probe.reasons[1:] == (
        "could not read gpu_health: line 1: nvidia-smi cannot reach GPU 0000:09:00.0: "
        "Unknown Error",
        "could not read gpus: line 1: nvidia-smi cannot reach GPU 0000:09:00.0: Unknown Error",
    )


def test_the_sweep_reads_a_lost_gpu_as_missing_and_drains_on_it() -> None:
    line = (SMI / "device-handle-unknown-error.txt").read_text()
    probe = interpret(document(gpu_health=line, gpus=line))
    judged = judge_node(
        probe, catalog=CATALOG, gpus_expected=8, running_jobs=(), cotenant_min_bytes=MIB
    )
    assert judged.health is ProbeVerdict.FAULTY
    assert judged.kinds() == (FindingKind.GPU_MISSING,)
    assert judged.deciding.startswith("nvidia-smi cannot reach GPU 0000:09:00.0: Unknown Error")
    assert FindingKind.GPU_MISSING in SweepSettings().drain_now


def test_unreachable_gpu_after_a_readable_block_is_named_not_called_garbage() -> None:
    """The line takes the place of the lost GPU's block, wherever that GPU comes in order."""
    healthy = (SMI / "gh200-550-uncorrectable-remapped-row.txt").read_text()
    lost = (SMI / "device-handle-unknown-error.txt").read_text()
    with pytest.raises(NvidiaSmiParseError) as raised:
        parse_query(healthy + lost)
    assert str(raised.value).endswith("nvidia-smi cannot reach GPU 0000:09:00.0: Unknown Error")


# --- kernel log lines of memory faults and of GPUs that never came up ------------------------


def test_dbe_and_page_retirement_failure_beside_a_gpu_that_fails_to_initialise() -> None:
    findings = parse_kernel_log(
        (DMESG / "gpu-operator-1146-rminitadapter-xid48-xid64.txt").read_text(), catalog=CATALOG
    )
    assert [(e.code, e.pci_bus_id, e.pid, e.process_name) for e in findings.xid_events] == [
        (48, "0000:07:00", None, None),
        (64, "0000:07:00", None, None),
    ]
    assert all(event.policy is XidPolicy.HARDWARE for event in findings.xid_events)
    (failure,) = findings.gpu_init_failures
    assert (failure.pci_bus_id, failure.attempts, failure.first_time) == ("0000:0a:00.0", 3, None)
    assert failure.text.endswith("NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)")


def test_dbe_and_retirement_failure_make_the_node_faulty_and_name_the_lost_gpu() -> None:
    kernel = (DMESG / "gpu-operator-1146-rminitadapter-xid48-xid64.txt").read_text()
    probe = interpret(document(kernel_log=kernel))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == (
        "XID 48 (Double Bit ECC Error) x1 on 0000:07:00, threshold 1: hardware",
        "XID 64 (GPU memory remapping failure) x1 on 0000:07:00, threshold 1: hardware",
        "GPU 0000:0a:00.0 failed to initialise (RmInitAdapter failed x3): "
        "the driver does not list it",
    )


def test_init_failure_in_ctime_format_is_no_xid_but_a_note() -> None:
    kernel = (DMESG / "illinois-scicomp-76-rminitadapter.txt").read_text()
    findings = parse_kernel_log(kernel, catalog=CATALOG)
    assert findings.xid_events == ()
    (failure,) = findings.gpu_init_failures
    assert (failure.pci_bus_id, failure.attempts) == ("0000:81:00.0", 2)
    probe = interpret(document(kernel_log=kernel))
    assert probe.verdict is ProbeVerdict.HEALTHY
    assert probe.reasons[-1] == (
        "GPU 0000:81:00.0 failed to initialise (RmInitAdapter failed x2): "
        "the driver does not list it"
    )


def test_row_remapper_failure_then_contained_error() -> None:
    kernel = (DMESG / "imbue-cluster-health-xid64-xid94.txt").read_text()
    events = parse_kernel_log(kernel, catalog=CATALOG).xid_events
    assert [(e.code, e.pci_bus_id, e.pid, e.process_name) for e in events] == [
        (64, "0000:0f:00", None, None),
        (94, "0000:0f:00", 2503421, "python3"),
    ]
    probe = interpret(document(kernel_log=kernel))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == (
        "XID 64 (GPU memory remapping failure) x1 on 0000:0f:00, threshold 1: hardware",
        "XID 94 (Contained memory error) x1 on 0000:0f:00, threshold 1: hardware",
    )


def test_contained_and_uncontained_errors_including_a_mig_instance() -> None:
    kernel = (DMESG / "nvidia-error-containment-xid94-xid95.txt").read_text()
    events = parse_kernel_log(kernel, catalog=CATALOG).xid_events
    assert [(e.code, e.pci_bus_id, e.pid) for e in events] == [
        (94, "0000:01:00", 7194),
        (94, "0000:01:00", 7062),
        (95, "0000:01:00", 7062),
    ]
    probe = interpret(document(kernel_log=kernel))
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == (
        "XID 94 (Contained memory error) x2 on 0000:01:00, threshold 1: hardware",
        "XID 95 (Uncontained memory error) x1 on 0000:01:00, threshold 1: hardware",
    )


# --- the dev cluster's fault states through the real probe program ---------------------------


@cache
def probe_output(state: str) -> str:
    """What medic-node-probe prints on a node in `state`, run here with the fixture tools."""
    env = {
        "PATH": f"{REPO / 'deploy' / 'devcluster' / 'fixture-bin'}:/usr/bin:/bin",
        "MEDIC_FIXTURE_DIR": str(STATES / state),
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


def probe_state(state: str, *, with_window: bool = True) -> NodeProbe:
    """The verdict on `state`, looking back ten minutes as after a job, or at the whole log."""
    now = datetime.now(UTC)
    window = TimeWindow(now - timedelta(minutes=10), now) if with_window else None
    return interpret_probe(
        "gpu-09", probe_output(state), probed_at=now, catalog=CATALOG, window=window
    )


def test_remap_failure_state_is_faulty_for_the_failed_remap_on_gpu_5() -> None:
    probe = probe_state("remap-failure")
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == (
        "XID 64 (GPU memory remapping failure) x1 on 0000:90:00, threshold 1: hardware",
        "XID 94 (Contained memory error) x1 on 0000:90:00, threshold 1: hardware",
        "GPU 5 (00000000:90:00.0): row remapping failure occurred",
        "GPU 5 (00000000:90:00.0): 1 uncorrectable ECC errors since the driver loaded",
    )
    gpu = probe.gpus[5]
    assert (gpu.remapped_rows_uncorrectable, gpu.remap_pending, gpu.remap_failure_occurred) == (
        8,
        False,
        True,
    )
    assert (gpu.ecc_volatile_uncorrectable, gpu.ecc_aggregate_uncorrectable) == (1, 9)
    others = [other for other in probe.gpus if other.index != 5]
    assert not any(
        other.remap_failure_occurred or other.ecc_aggregate_uncorrectable for other in others
    )


def test_ecc_uncorrectable_state_is_faulty_for_uncorrectable_ecc_without_a_remap_fault() -> None:
    probe = probe_state("ecc-uncorrectable")
    assert probe.verdict is ProbeVerdict.FAULTY
    assert probe.reasons == (
        "XID 48 (Double Bit ECC Error) x1 on 0000:87:00, threshold 1: hardware",
        "XID 94 (Contained memory error) x1 on 0000:87:00, threshold 1: hardware",
        "GPU 4 (00000000:87:00.0): 2 uncorrectable ECC errors since the driver loaded",
    )
    gpu = probe.gpus[4]
    assert (gpu.ecc_volatile_uncorrectable, gpu.ecc_aggregate_uncorrectable) == (2, 3)
    assert (gpu.remapped_rows_uncorrectable, gpu.remap_pending, gpu.remap_failure_occurred) == (
        1,
        False,
        False,
    )


def test_gpu_missing_state_lists_seven_gpus_without_the_one_that_failed_to_initialise() -> None:
    probe = probe_state("gpu-missing")
    assert len(probe.gpus) == 7
    assert [gpu.index for gpu in probe.gpus] == list(range(7))
    assert "00000000:47:00.0" not in {gpu.pci_bus_id for gpu in probe.gpus}
    assert probe.verdict is ProbeVerdict.HEALTHY  # missing against gres is the sweep's judgement
    assert probe.xid_events == ()  # the boot's lines are days before any recent window
    assert probe.reasons == (
        "7 GPUs: no pending or failed row remap, no uncorrectable ECC, no hardware XID in the "
        "window, no other process holding VRAM",
    )
    tools = parse_document(probe_output("gpu-missing")).tools
    assert "Attached GPUs                             : 7\n" in tools["gpu_health"].stdout


def test_gpu_missing_state_names_the_lost_gpu_when_the_whole_log_is_read() -> None:
    probe = probe_state("gpu-missing", with_window=False)
    assert probe.verdict is ProbeVerdict.HEALTHY
    assert probe.reasons[-1] == (
        "GPU 0000:47:00.0 failed to initialise (RmInitAdapter failed x2): "
        "the driver does not list it"
    )
