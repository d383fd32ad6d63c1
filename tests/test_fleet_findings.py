"""A node probe judged for the fleet: gres read as Slurm spells it, findings from the real probe
program's documents and from constructed GPU states, the worst finding first and deciding."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.evidence.kernel_log import TimeWindow
from daemon.evidence.nvidia_smi import MIB
from daemon.evidence.probe import interpret_probe
from daemon.evidence.records import (
    ComputeApp,
    FindingKind,
    GpuHealth,
    NodeProbe,
    ProbeVerdict,
    XidEvent,
    XidPolicy,
)
from daemon.evidence.xid import XidCatalog, XidOverride
from daemon.fleet.findings import NodeJudgement, gres_gpu_count, judge_node
from tests.test_probe import CATALOG, document, interpret, run_probe_program, tool

NOW = datetime(2026, 11, 24, 18, 0, tzinfo=UTC)
COTENANT_MIN = 1024 * MIB
# Worst first: what the node's health and deciding fact are taken from.
RANK = {ProbeVerdict.FAULTY: 0, ProbeVerdict.UNREACHABLE: 1, ProbeVerdict.DEGRADED: 2}


@pytest.mark.parametrize(
    ("gres", "count"),
    [
        ("gpu:8", 8),
        ("gpu:a100:8", 8),
        ("gpu:a100:8(S:0-1)", 8),
        ("gpu:h100:8(S:0,1)", 8),  # a socket list has commas of its own
        ("gpu:a100:4,gpu:v100:2", 6),
        ("gpu:a100:4(S:0),gpu:v100:2(S:1)", 6),
        ("gpu:a100:4,mps:100", 4),
        ("gpu:h100:4(S:0,1),shard:h100:16", 4),
        ("mps:100,gpu:2", 2),
        ("(null)", None),
        ("", None),
        (None, None),
        ("shard:8", None),
        ("garbage", None),
        ("gpu:lots", None),  # a gpu entry nobody understood: no count at all, not a guess
        ("gpu:a100:4,gpu:x:y:2", None),
        ("gpu:a100:4(S:0", None),
    ],
)
def test_gres_gpu_count_on_slurm_spellings(gres: str | None, count: int | None) -> None:
    assert gres_gpu_count(gres) == count


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="gpu:a10(S,)-8 n", max_size=40))
def test_any_gres_text_is_a_count_or_none(gres: str) -> None:
    count = gres_gpu_count(gres)
    if count is not None:
        assert count >= 0
        assert "gpu:" in gres


def judge(
    probe: NodeProbe,
    *,
    expected: int | None = 8,
    jobs: tuple[int, ...] = (),
    catalog: XidCatalog = CATALOG,
) -> NodeJudgement:
    return judge_node(
        probe,
        catalog=catalog,
        gpus_expected=expected,
        running_jobs=jobs,
        cotenant_min_bytes=COTENANT_MIN,
    )


def real_probe(state: str) -> NodeProbe:
    """The probe program run on a dev-cluster node state, read as the prober reads it."""
    now = datetime.now(UTC)
    return interpret_probe(
        "gpu-09",
        run_probe_program(state),
        probed_at=now,
        catalog=CATALOG,
        window=TimeWindow(now - timedelta(minutes=10), now),
        cotenant_min_bytes=COTENANT_MIN,
    )


@pytest.mark.parametrize(
    ("state", "health", "deciding", "kinds"),
    [
        (
            "healthy",  # its application XID 13 of a day ago is outside the window
            ProbeVerdict.HEALTHY,
            "8 GPUs of 8: no remap pending or failed",
            (),
        ),
        (
            "row-remap-pending",
            ProbeVerdict.FAULTY,
            "GPU 2 (00000000:47:00.0): row remap pending (1 correctable, 0 uncorrectable rows)",
            (FindingKind.REMAP_PENDING, FindingKind.ECC_CORRECTABLE),
        ),
        (
            "xid79",  # its XID 45 (cleanup after the death) is the application's, not a finding
            ProbeVerdict.FAULTY,
            "XID 79 (GPU has fallen off the bus) x1 on 0000:47:00",
            (FindingKind.FALLEN_OFF_BUS,),
        ),
        (
            "cotenant",
            ProbeVerdict.DEGRADED,
            "GPU 3 (00000000:4E:00.0): pid 31337 (python3) holds 30.00 GiB outside any job",
            (FindingKind.COTENANT,),
        ),
        (
            "remap-failure",
            ProbeVerdict.FAULTY,
            "GPU 5 (00000000:90:00.0): row remapping failure occurred",
            (
                FindingKind.REMAP_FAILURE,
                FindingKind.ECC_UNCORRECTABLE_VOLATILE,
                FindingKind.XID_HARDWARE,
            ),
        ),
        (
            "ecc-uncorrectable",
            ProbeVerdict.FAULTY,
            "GPU 4 (00000000:87:00.0): 2 uncorrectable ECC errors since the driver loaded",
            (FindingKind.ECC_UNCORRECTABLE_VOLATILE, FindingKind.XID_HARDWARE),
        ),
        (
            "gpu-missing",
            ProbeVerdict.FAULTY,
            "Slurm's gres promises 8 GPUs, nvidia-smi lists 7: 1 missing",
            (FindingKind.GPU_MISSING,),
        ),
        (
            "garbage",
            ProbeVerdict.UNREACHABLE,
            "not probed: gpu_health: line 1 is not nvidia-smi -q output",
            (FindingKind.UNREACHABLE,),
        ),
    ],
)
def test_real_probe_documents_judged_for_an_idle_node(
    state: str, health: ProbeVerdict, deciding: str, kinds: tuple[FindingKind, ...]
) -> None:
    judgement = judge(real_probe(state))
    assert judgement.health is health
    assert judgement.deciding.startswith(deciding)
    assert judgement.kinds() == kinds
    assert [RANK[f.health] for f in judgement.findings] == sorted(
        RANK[f.health] for f in judgement.findings
    )


def test_real_cotenant_state_is_healthy_while_a_job_runs_there() -> None:
    """The same process is the running job's business: a note, never a finding."""
    judgement = judge(real_probe("cotenant"), jobs=(4242,))
    assert judgement.health is ProbeVerdict.HEALTHY
    assert judgement.findings == ()
    assert judgement.running_jobs == (4242,)
    assert judgement.notes == (
        "processes hold GPU memory while job(s) 4242 run here: not judged as co-tenants",
    )


def test_real_remap_pending_is_faulty_whether_or_not_a_job_runs() -> None:
    probe = real_probe("row-remap-pending")
    assert judge(probe, jobs=(7,)).kinds() == judge(probe).kinds()
    assert judge(probe, jobs=(7,)).health is ProbeVerdict.FAULTY


def test_timed_out_tools_as_the_hang_state_leaves_them_are_unreachable() -> None:
    """The document a hanging nvidia-smi leaves (every tool killed on the node)."""
    killed = tool("", -9, timed_out=True)
    probe = interpret(document(gpu_health=killed, gpus=killed, compute_apps=killed))
    judgement = judge(probe)
    assert judgement.health is ProbeVerdict.UNREACHABLE
    assert judgement.deciding == (
        "not probed: gpu_health: timed out on the node; gpus: timed out on the node; "
        "compute_apps: timed out on the node"
    )
    assert judgement.gpus_seen == 0


def test_a_probe_that_never_answered_is_unreachable_with_its_error() -> None:
    probe = NodeProbe(
        "gpu-09", NOW, ProbeVerdict.UNREACHABLE, ("no answer",), error="connection refused"
    )
    judgement = judge(probe)
    assert (judgement.health, judgement.deciding) == (
        ProbeVerdict.UNREACHABLE,
        "not probed: connection refused",
    )


def gpu(index: int, **facts: Any) -> GpuHealth:
    base = GpuHealth(
        index=index,
        uuid=f"GPU-{index:04d}",
        pci_bus_id=f"00000000:{index + 7:02X}:00.0",
        memory_total_bytes=81920 * MIB,
        memory_used_bytes=0,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        remap_pending=False,
        remap_failure_occurred=False,
        ecc_volatile_uncorrectable=0,
        ecc_aggregate_uncorrectable=0,
        ecc_volatile_correctable=0,
        ecc_aggregate_correctable=0,
        retired_pages_pending=False,
    )
    return replace(base, **facts)


def xid(code: int, bus: str = "0000:07:00", catalog: XidCatalog = CATALOG) -> XidEvent:
    entry = catalog.entry(code)
    return XidEvent(
        code=code,
        pci_bus_id=bus,
        pid=None,
        process_name=None,
        time=NOW,
        text=f"NVRM: Xid (PCI:{bus}): {code}",
        policy=entry.policy,
        meaning=entry.meaning,
    )


def node(
    gpus: tuple[GpuHealth, ...] | None = None,
    xids: tuple[XidEvent, ...] = (),
    verdict: ProbeVerdict = ProbeVerdict.HEALTHY,
    error: str | None = None,
) -> NodeProbe:
    listed = tuple(gpu(n) for n in range(8)) if gpus is None else gpus
    return NodeProbe("gpu-09", NOW, verdict, ("r",), listed, xids, error=error)


def with_gpu(index: int, **facts: Any) -> tuple[GpuHealth, ...]:
    return tuple(gpu(n, **facts) if n == index else gpu(n) for n in range(8))


def test_clean_node_is_healthy_and_says_what_was_looked_at() -> None:
    judgement = judge(node())
    assert (judgement.health, judgement.findings) == (ProbeVerdict.HEALTHY, ())
    assert judgement.deciding == (
        "8 GPUs of 8: no remap pending or failed, no uncorrectable ECC, no hardware XID"
    )


def test_remap_failure_is_faulty_on_its_gpu() -> None:
    judgement = judge(node(with_gpu(5, remap_failure_occurred=True)))
    assert judgement.health is ProbeVerdict.FAULTY
    assert judgement.kinds() == (FindingKind.REMAP_FAILURE,)
    assert judgement.findings[0].gpu == 5
    assert judgement.deciding == "GPU 5 (00000000:0C:00.0): row remapping failure occurred"


def test_volatile_uncorrectable_ecc_is_faulty_and_hides_the_aggregate() -> None:
    judgement = judge(
        node(with_gpu(1, ecc_volatile_uncorrectable=2, ecc_aggregate_uncorrectable=9))
    )
    assert judgement.health is ProbeVerdict.FAULTY
    assert judgement.kinds() == (FindingKind.ECC_UNCORRECTABLE_VOLATILE,)
    assert judgement.deciding.endswith("2 uncorrectable ECC errors since the driver loaded")


def test_aggregate_uncorrectable_ecc_alone_is_degraded() -> None:
    judgement = judge(node(with_gpu(1, ecc_aggregate_uncorrectable=9)))
    assert judgement.health is ProbeVerdict.DEGRADED
    assert judgement.kinds() == (FindingKind.ECC_UNCORRECTABLE_AGGREGATE,)
    assert judgement.deciding.endswith("9 uncorrectable ECC errors in its lifetime")


def test_pending_remap_names_its_rows_and_the_reset_it_needs() -> None:
    judgement = judge(
        node(
            with_gpu(2, remap_pending=True, remapped_rows_correctable=1, retired_pages_pending=True)
        )
    )
    assert judgement.health is ProbeVerdict.FAULTY
    assert judgement.kinds() == (FindingKind.REMAP_PENDING, FindingKind.RETIRED_PAGES_PENDING)
    assert "row remap pending (1 correctable, 0 uncorrectable rows)" in judgement.deciding
    assert judgement.deciding.endswith("needs a GPU reset")


@pytest.mark.parametrize(("listed", "expected", "missing"), [(7, 8, 1), (6, 8, 2)])
def test_gpus_missing_against_gres(listed: int, expected: int, missing: int) -> None:
    judgement = judge(node(tuple(gpu(n) for n in range(listed))), expected=expected)
    assert judgement.health is ProbeVerdict.FAULTY
    assert judgement.kinds() == (FindingKind.GPU_MISSING,)
    assert judgement.deciding.startswith(
        f"Slurm's gres promises {expected} GPUs, nvidia-smi lists {listed}: {missing} missing"
    )
    assert (judgement.gpus_seen, judgement.gpus_expected) == (listed, expected)


@pytest.mark.parametrize("expected", [None, 7, 8])
def test_no_gpu_is_missing_without_a_gres_or_with_as_many_listed(expected: int | None) -> None:
    judgement = judge(node(), expected=expected)
    assert judgement.health is ProbeVerdict.HEALTHY


def app(pid: int | None, used_mib: int | None, name: str | None = "python3") -> ComputeApp:
    used = None if used_mib is None else used_mib * MIB
    return ComputeApp(gpu_uuid="GPU-0003", pid=pid, process_name=name, used_bytes=used)


def test_cotenant_on_an_idle_node_is_degraded() -> None:
    judgement = judge(node(with_gpu(3, compute_apps=(app(31337, 30720),))))
    assert judgement.health is ProbeVerdict.DEGRADED
    assert judgement.kinds() == (FindingKind.COTENANT,)
    assert judgement.deciding == (
        "GPU 3 (00000000:0A:00.0): pid 31337 (python3) holds 30.00 GiB outside any job"
    )


def test_a_nameless_process_of_unknown_size_is_a_cotenant() -> None:
    judgement = judge(node(with_gpu(3, compute_apps=(app(None, None, name=None),))))
    assert judgement.kinds() == (FindingKind.COTENANT,)
    assert "an unnamed process (no name: a zombie or another namespace) holds memory" in (
        judgement.deciding
    )


def test_a_small_process_is_not_a_cotenant() -> None:
    judgement = judge(node(with_gpu(3, compute_apps=(app(99, 1023),))))
    assert judgement.health is ProbeVerdict.HEALTHY


def test_a_process_on_a_busy_node_is_a_note_not_a_finding() -> None:
    judgement = judge(node(with_gpu(3, compute_apps=(app(31337, 30720),))), jobs=(11, 12))
    assert judgement.health is ProbeVerdict.HEALTHY
    assert judgement.notes == (
        "processes hold GPU memory while job(s) 11, 12 run here: not judged as co-tenants",
    )


def test_a_busy_node_keeps_its_memory_findings() -> None:
    gpus = with_gpu(3, remap_failure_occurred=True, compute_apps=(app(31337, 30720),))
    judgement = judge(node(gpus), jobs=(11,))
    assert judgement.kinds() == (FindingKind.REMAP_FAILURE,)


def test_xid_79_is_fallen_off_the_bus() -> None:
    judgement = judge(node(xids=(xid(79, "0000:47:00"),)))
    assert judgement.health is ProbeVerdict.FAULTY
    assert judgement.kinds() == (FindingKind.FALLEN_OFF_BUS,)
    assert judgement.deciding == "XID 79 (GPU has fallen off the bus) x1 on 0000:47:00"


def test_hardware_xid_counts_its_events_and_buses() -> None:
    events = (xid(48, "0000:87:00"), xid(48, "0000:07:00"), xid(48, "0000:87:00"))
    judgement = judge(node(xids=events))
    assert judgement.kinds() == (FindingKind.XID_HARDWARE,)
    assert judgement.deciding == "XID 48 (Double Bit ECC Error) x3 on 0000:07:00, 0000:87:00"


@pytest.mark.parametrize(
    ("code", "count", "kinds"),
    [
        (13, 5, ()),  # the application's fault, not the node's
        (45, 5, ()),
        (8, 2, ()),  # a driver XID under its threshold of 3
        (8, 3, (FindingKind.XID_DRIVER,)),
        (63, 1, ()),  # a remapping event: hardware, but only from 2 on
        (63, 2, (FindingKind.XID_HARDWARE,)),
        (94, 1, (FindingKind.XID_HARDWARE,)),
        (4000, 1, (FindingKind.XID_DRIVER,)),  # a code newer than the catalog
    ],
)
def test_xids_by_catalog_class_and_threshold(
    code: int, count: int, kinds: tuple[FindingKind, ...]
) -> None:
    judgement = judge(node(xids=(xid(code),) * count))
    assert judgement.kinds() == kinds
    health = {(): ProbeVerdict.HEALTHY, (FindingKind.XID_DRIVER,): ProbeVerdict.DEGRADED}
    assert judgement.health is health.get(kinds, ProbeVerdict.FAULTY)
    if kinds:
        assert judgement.deciding.startswith(f"XID {code} (")
        assert f" x{count} on 0000:07:00" in judgement.deciding


def test_operator_overrides_change_the_class() -> None:
    catalog = CATALOG.with_overrides(
        {48: XidOverride(policy=XidPolicy.IGNORE), 79: XidOverride(policy=XidPolicy.DRIVER)}
    )
    judgement = judge(
        node(xids=(xid(48, catalog=catalog), xid(79, catalog=catalog))), catalog=catalog
    )
    assert judgement.kinds() == (FindingKind.XID_DRIVER,)
    assert judgement.health is ProbeVerdict.DEGRADED


def test_faulty_comes_before_degraded_whatever_the_gpu_order() -> None:
    gpus = (
        gpu(0, ecc_volatile_correctable=177),
        gpu(1, compute_apps=(app(5, 2048),)),
        gpu(2, remap_pending=True),
        *(gpu(n) for n in range(3, 8)),
    )
    judgement = judge(node(gpus, xids=(xid(8),) * 3))
    assert judgement.health is ProbeVerdict.FAULTY
    assert judgement.deciding.startswith("GPU 2 (00000000:09:00.0): row remap pending")
    assert [finding.health for finding in judgement.findings] == [
        ProbeVerdict.FAULTY,
        ProbeVerdict.DEGRADED,
        ProbeVerdict.DEGRADED,
        ProbeVerdict.DEGRADED,
    ]
    # At equal severity the cards' own state comes before the XIDs of the window.
    assert judgement.kinds() == (
        FindingKind.REMAP_PENDING,
        FindingKind.ECC_CORRECTABLE,
        FindingKind.COTENANT,
        FindingKind.XID_DRIVER,
    )


def test_a_partly_read_node_is_unreachable_unless_something_is_faulty() -> None:
    partly = node(with_gpu(0, ecc_volatile_correctable=3), verdict=ProbeVerdict.UNREACHABLE)
    judgement = judge(replace(partly, error="gpu_health: timed out on the node"))
    assert judgement.health is ProbeVerdict.UNREACHABLE
    assert judgement.deciding == "partly read: gpu_health: timed out on the node"
    assert judgement.kinds() == (FindingKind.UNREACHABLE, FindingKind.ECC_CORRECTABLE)
    faulty = replace(partly, gpus=with_gpu(0, remap_failure_occurred=True))
    assert judge(faulty).health is ProbeVerdict.FAULTY


counts = st.one_of(st.none(), st.integers(min_value=0, max_value=3))
flags = st.one_of(st.none(), st.booleans())
apps = st.lists(
    st.builds(
        ComputeApp,
        gpu_uuid=st.just("GPU-x"),
        pid=st.one_of(st.none(), st.integers(min_value=1, max_value=99999)),
        process_name=st.one_of(st.none(), st.text(max_size=20)),
        used_bytes=st.one_of(st.none(), st.integers(min_value=0, max_value=4 * COTENANT_MIN)),
    ),
    max_size=2,
)
gpu_states = st.builds(
    GpuHealth,
    index=st.integers(min_value=0, max_value=15),
    uuid=st.one_of(st.none(), st.text(max_size=12)),
    pci_bus_id=st.one_of(st.none(), st.text(max_size=16)),
    memory_total_bytes=st.none(),
    memory_used_bytes=st.none(),
    remapped_rows_correctable=counts,
    remapped_rows_uncorrectable=counts,
    remap_pending=flags,
    remap_failure_occurred=flags,
    ecc_volatile_uncorrectable=counts,
    ecc_aggregate_uncorrectable=counts,
    ecc_volatile_correctable=counts,
    ecc_aggregate_correctable=counts,
    retired_pages_pending=flags,
    compute_apps=apps.map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(
    gpus=st.lists(gpu_states, max_size=9).map(tuple),
    codes=st.lists(st.sampled_from([8, 13, 45, 48, 63, 79, 94, 4000]), max_size=6),
    verdict=st.sampled_from(list(ProbeVerdict)),
    expected=st.one_of(st.none(), st.integers(min_value=0, max_value=9)),
    jobs=st.lists(st.integers(min_value=1, max_value=10**7), max_size=3).map(tuple),
)
def test_any_probe_is_judged_and_health_is_the_worst_finding(
    gpus: tuple[GpuHealth, ...],
    codes: list[int],
    verdict: ProbeVerdict,
    expected: int | None,
    jobs: tuple[int, ...],
) -> None:
    probe = NodeProbe(
        "gpu-09", NOW, verdict, ("r",), gpus, tuple(xid(code) for code in codes), error=None
    )
    judgement = judge(probe, expected=expected, jobs=jobs)
    if not judgement.findings:
        assert judgement.health is ProbeVerdict.HEALTHY
        return
    worst = min(judgement.findings, key=lambda finding: RANK[finding.health])
    assert judgement.health is worst.health
    assert judgement.deciding == judgement.findings[0].text
    ranks = [RANK[finding.health] for finding in judgement.findings]
    assert ranks == sorted(ranks)
    if jobs:
        assert FindingKind.COTENANT not in judgement.kinds()
