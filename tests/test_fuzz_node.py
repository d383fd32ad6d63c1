"""Fuzz suite of the node-output parsers: the kernel log (dmesg/journal lines, XIDs, OOM
kills), nvidia-smi's three outputs, the probe's JSON document and the XID catalog, seeded
with real samples (tests/data/dmesg, tests/data/nvidia-smi, the dev cluster's node states)
and with the hostile inputs of issue 10.

The properties: each parser raises only its documented error (the kernel log parser and
`interpret_probe` none at all: garbage is a finding or a verdict), and every number that
reaches a record is ASCII-read and in range.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from daemon.evidence.kernel_log import (
    MAX_LINE_CHARS,
    MAX_LINES,
    KernelLogFindings,
    TimeWindow,
    parse_kernel_log,
)
from daemon.evidence.nvidia_smi import (
    MAX_GPUS,
    MAX_PROCESS_NAME_CHARS,
    MIB,
    GpuMemoryHealth,
    NvidiaSmiParseError,
    parse_compute_apps,
    parse_gpu_rows,
    parse_query,
)
from daemon.evidence.probe import ProbeDocumentError, interpret_probe, parse_document
from daemon.evidence.records import MAX_GPU_INDEX, MAX_PID, NodeProbe, ProbeVerdict
from daemon.evidence.xid import CATALOG_RESOURCE, XidCatalogError, load_catalog, parse_catalog

DATA = Path(__file__).parent / "data"
STATES = Path(__file__).parent.parent / "deploy" / "devcluster" / "node-states"
CATALOG = load_catalog()
NOW = datetime(2026, 11, 22, 3, 30, tzinfo=UTC)
WINDOW = TimeWindow(NOW - timedelta(hours=1), NOW)
# What a counter, a memory figure or a sum of five counters may reach (see nvidia_smi).
MAX_COUNTER_SUM = 5 * (10**15 - 1)
MAX_BYTES = 2**30 * MIB
NOT_ASCII_DIGITS = ["²", "\u0661\u0662", "\u0967", "\uff11"]


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _mangled(data: st.DataObject, text: str, alphabet: str) -> str:
    """`text` with up to 40 characters somewhere replaced by up to 20 drawn from `alphabet`."""
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 40)))
    filler = data.draw(st.text(alphabet=alphabet, max_size=20))
    return text[:start] + filler + text[end:]


# -- kernel log -----------------------------------------------------------------------------------

DMESG = [_read(path) for path in sorted((DATA / "dmesg").glob("*.txt"))]
DMESG += [_read(path / "dmesg.txt") for path in sorted(STATES.iterdir()) if path.is_dir()]
XID_LINE = "2026-11-22T03:10:00,5+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name={name}, x"
KILL_LINE = "2026-11-22T03:10:00+00:00 Out of memory: Killed process {pid} ({name}) total-vm:1kB"


def _check_findings(found: KernelLogFindings) -> None:
    assert found.lines_in_window <= found.lines_read <= MAX_LINES
    for event in found.xid_events:
        assert 0 <= event.code <= 9999
        assert event.pid is None or 0 <= event.pid <= MAX_PID
        assert event.process_name is None or len(event.process_name) <= 64
        assert len(event.text) <= MAX_LINE_CHARS
        if event.time is not None:
            assert 1970 <= event.time.year <= 9998
    for kill in found.host_oom_kills:
        assert kill.pid is None or 0 <= kill.pid <= MAX_PID
        assert len(kill.text) <= MAX_LINE_CHARS


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mangled_kernel_logs_give_findings_in_range(data: st.DataObject) -> None:
    text = _mangled(
        data,
        data.draw(st.sampled_from(DMESG)),
        "NVRM: Xid(PCI0:3b)79,pid=name²\u0661 \n+-T.[]" + "0123456789",
    )
    _check_findings(parse_kernel_log(text, catalog=CATALOG, window=WINDOW))
    _check_findings(parse_kernel_log(text, catalog=CATALOG))


@settings(max_examples=200, deadline=None)
@given(
    template=st.sampled_from([XID_LINE, KILL_LINE]),
    pid=st.one_of(st.sampled_from(NOT_ASCII_DIGITS), st.integers(-5, 10**12).map(str)),
    # A process name as the kernel prints it: up to 15 characters, never a newline.
    name=st.text(
        alphabet=st.characters(exclude_categories=["Cs", "Cc"], exclude_characters=",)"),
        min_size=1,
        max_size=15,
    ),
)
@example(template=XID_LINE, pid="²", name="python3")
@example(template=KILL_LINE, pid="²", name="python3")
@example(template=KILL_LINE, pid="9" * 4000, name="python3")
@example(template=XID_LINE, pid=str(MAX_PID + 1), name="x")
def test_pids_are_ascii_and_in_range(template: str, pid: str, name: str) -> None:
    found = parse_kernel_log(template.format(pid=pid, name=name), catalog=CATALOG)
    _check_findings(found)
    valid = pid.isascii() and pid.isdigit() and int(pid) <= MAX_PID
    if template == XID_LINE:
        (event,) = found.xid_events
        assert event.pid == (int(pid) if valid else None)
    else:
        assert [kill.pid for kill in found.host_oom_kills] == ([int(pid)] if valid else [])


@pytest.mark.parametrize(
    "stamp",
    [
        "0001-01-01T00:00:00+14:00",
        "9999-12-31T23:59:59-12:00",
        "\u0662\u0660\u0662\u0666-11-22T03:10:00+00:00",
    ],
)
def test_times_no_record_can_hold_are_no_times(stamp: str) -> None:
    line = f"{stamp} NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
    (event,) = parse_kernel_log(line, catalog=CATALOG).xid_events
    assert event.time is None


def test_memcg_context_with_a_superscript_pid_is_ignored_not_a_crash() -> None:
    text = (
        "2026-11-22T03:10:00+00:00 oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),pid=²\n"
        "2026-11-22T03:10:00+00:00 Memory cgroup out of memory: Killed process 7 (python3)\n"
    )
    (kill,) = parse_kernel_log(text, catalog=CATALOG).host_oom_kills
    assert (kill.pid, kill.cgroup) == (7, True)


def test_a_flood_of_lines_is_cut_to_the_newest_with_a_note() -> None:
    old = "2026-11-22T02:00:00+00:00 NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE\n"
    filler = "2026-11-22T03:00:00+00:00 nothing\n" * MAX_LINES
    new = "2026-11-22T03:10:00+00:00 NVRM: Xid (PCI:0000:3b:00): 94, pid=2, x\n"
    found = parse_kernel_log(old + filler + new, catalog=CATALOG)
    assert [event.code for event in found.xid_events] == [94]
    assert found.lines_read == MAX_LINES
    assert found.notes[0].startswith(f"kernel log had {MAX_LINES + 2} lines")


def test_a_line_of_repeated_xid_openings_is_cut_and_read() -> None:
    line = "2026-11-22T03:10:00+00:00 " + "NVRM: Xid (0000:3b:00" * 50_000
    found = parse_kernel_log(line, catalog=CATALOG)
    assert found.xid_events == ()
    assert f"longer than {MAX_LINE_CHARS} characters were cut" in found.notes[0]


# -- nvidia-smi ----------------------------------------------------------------------------------

QUERY_SAMPLES = [_read(path) for path in sorted((DATA / "nvidia-smi").glob("*.txt"))]
NODE_STATES = sorted(path for path in STATES.iterdir() if path.is_dir())
QUERY_SAMPLES += [_read(path / "nvidia-smi-q.txt") for path in NODE_STATES]
ROWS_SAMPLES = [_read(path / "query-gpu.csv") for path in NODE_STATES]
APPS_SAMPLES = [_read(STATES / "cotenant" / "compute-apps.csv")]
_NUMBERS = "0123456789²\u0661 :NA/[]MiB,\n"


def _check_health(gpu: GpuMemoryHealth) -> None:
    counts = (
        gpu.remapped_rows_correctable,
        gpu.remapped_rows_uncorrectable,
        gpu.ecc_volatile_correctable,
        gpu.ecc_volatile_uncorrectable,
        gpu.ecc_aggregate_correctable,
        gpu.ecc_aggregate_uncorrectable,
        gpu.retired_pages_single_bit,
        gpu.retired_pages_double_bit,
    )
    assert all(count is None or 0 <= count <= MAX_COUNTER_SUM for count in counts)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
@example(data=None)
def test_mangled_query_output_reads_in_range_or_fails_cleanly(data: st.DataObject | None) -> None:
    if data is None:  # the input: a counter in superscript digits
        text = QUERY_SAMPLES[0].replace(": 0\n", ": ²\n", 1)
    else:
        text = _mangled(data, data.draw(st.sampled_from(QUERY_SAMPLES)), _NUMBERS)
    try:
        gpus = parse_query(text)
    except NvidiaSmiParseError:
        return
    assert len(gpus) <= MAX_GPUS
    for gpu in gpus:
        _check_health(gpu)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mangled_csv_outputs_read_in_range_or_fail_cleanly(data: st.DataObject) -> None:
    rows_text = _mangled(data, data.draw(st.sampled_from(ROWS_SAMPLES)), _NUMBERS)
    apps_text = _mangled(data, data.draw(st.sampled_from(APPS_SAMPLES)), _NUMBERS)
    try:
        rows = parse_gpu_rows(rows_text)
    except NvidiaSmiParseError:
        rows = ()
    for row in rows:
        assert 0 <= row.index <= MAX_GPU_INDEX
        for figure in (row.memory_total_bytes, row.memory_used_bytes):
            assert figure is None or 0 <= figure <= MAX_BYTES
    try:
        apps = parse_compute_apps(apps_text)
    except NvidiaSmiParseError:
        apps = ()
    for app in apps:
        assert app.pid is None or 0 <= app.pid <= MAX_PID
        assert app.used_bytes is None or 0 <= app.used_bytes <= MAX_BYTES
        assert app.process_name is None or len(app.process_name) <= MAX_PROCESS_NAME_CHARS


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (
            parse_query,
            "GPU 00000000:07:00.0\n    Remapped Rows\n        Correctable Error : " + "9" * 5000,
        ),
        (parse_query, "GPU 00000000:07:00.0\n" + "    x : 1\n" * (MAX_GPUS * 1000)),
        (parse_query, "GPU 00000000:07:00.0\n    " + "x" * 10_000 + " : 1\n"),
        (parse_gpu_rows, "², GPU-a, 0000:01:00.0, 80 MiB, 0 MiB\n"),
        (parse_gpu_rows, "0, GPU-a, 0000:01:00.0, ²² MiB, 0 MiB\n"),
        (parse_gpu_rows, "0, GPU-a, 0000:01:00.0, " + "9" * 5000 + " MiB, 0 MiB\n"),
        (parse_gpu_rows, f"{MAX_GPU_INDEX + 1}, GPU-a, 0000:01:00.0, 80 MiB, 0 MiB\n"),
        (parse_compute_apps, f"GPU-a, {MAX_PID + 1}, python3, 80 MiB\n"),
        (parse_compute_apps, "GPU-a, 1, python3, " + "9" * 5000 + " MiB\n"),
        (parse_compute_apps, "\n" * 1_000_000),
    ],
)
def test_hostile_nvidia_smi_outputs_are_its_parse_error(parse: Any, text: str) -> None:
    with pytest.raises(NvidiaSmiParseError):
        parse(text)


def test_a_cotenant_with_a_huge_name_is_still_seen() -> None:
    (app,) = parse_compute_apps(f"GPU-a, 77, /x/{'y' * 100_000}, 30720 MiB\n")
    assert (app.pid, app.used_bytes) == (77, 30720 * MIB)
    assert app.process_name is not None
    assert len(app.process_name) == MAX_PROCESS_NAME_CHARS


# -- the probe document ----------------------------------------------------------------------------


def _document(**tools: Any) -> dict[str, Any]:
    base = {
        "kernel_log": {"exit_code": 0, "stdout": DMESG[0], "stderr": ""},
        "gpu_health": {"exit_code": 0, "stdout": QUERY_SAMPLES[0], "stderr": ""},
        "gpus": {"exit_code": 0, "stdout": ROWS_SAMPLES[0], "stderr": ""},
        "compute_apps": {"exit_code": 0, "stdout": "", "stderr": ""},
    }
    base.update(tools)
    return {"format": "medic-node-probe/1", "hostname": "gpu-09", "tools": base}


def _interpret(text: str) -> NodeProbe:
    return interpret_probe("gpu-09", text, probed_at=NOW, catalog=CATALOG, window=WINDOW)


def _check_verdict(probe: NodeProbe) -> None:
    assert probe.reasons
    if probe.verdict is ProbeVerdict.HEALTHY:
        assert probe.gpus
    if probe.verdict is ProbeVerdict.UNREACHABLE:
        assert probe.error


_ODD_TOOL_VALUES: list[Any] = [
    None,
    True,
    10**30,
    -(10**30),
    2**63,
    1e308,
    [],
    {},
    {"a": [1]},
    "²",
    "\x00" * 10,
]
_TOOL_VALUES = st.one_of(
    st.sampled_from(_ODD_TOOL_VALUES),
    st.text(max_size=30),
    st.integers(),
)


@settings(max_examples=200, deadline=None)
@given(
    tool=st.sampled_from(["kernel_log", "gpu_health", "gpus", "compute_apps"]),
    key=st.sampled_from(["exit_code", "stdout", "stderr", "timed_out", "error", "truncated"]),
    value=_TOOL_VALUES,
)
@example(tool="gpu_health", key="exit_code", value=10**30)
@example(tool="gpu_health", key="stdout", value={"a": [1]})
@example(tool="kernel_log", key="stderr", value=["x"])
def test_any_tool_entry_gives_a_verdict(tool: str, key: str, value: Any) -> None:
    document = _document()
    document["tools"][tool][key] = value
    _check_verdict(_interpret(json.dumps(document)))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        '{"format": "medic-node-probe/1", "tools": {}, "hostname": ' + "9" * 5000 + "}",
        '{"format": "medic-node-probe/1", "tools": ' + "[" * 50_000,
        (STATES / "garbage" / "garbage.bin").read_bytes().decode("latin-1"),
    ],
)
def test_hostile_documents_are_unreadable_probe_output(text: str) -> None:
    with pytest.raises(ProbeDocumentError):
        parse_document(text)
    probe = _interpret(text)
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.error is not None
    assert probe.error.startswith("unreadable probe output")


def test_the_garbage_node_state_is_a_clear_unparseable_finding() -> None:
    """The dev cluster's `garbage` state: nvidia-smi prints binary bytes."""
    garbage = STATES / "garbage"
    document = _document(
        kernel_log={"exit_code": 0, "stdout": _read(garbage / "dmesg.txt"), "stderr": ""},
        gpu_health={"exit_code": 0, "stdout": _read(garbage / "garbage.bin"), "stderr": ""},
        gpus={"exit_code": 0, "stdout": _read(garbage / "garbage.bin"), "stderr": ""},
    )
    probe = _interpret(json.dumps(document))
    assert probe.verdict is ProbeVerdict.UNREACHABLE
    assert probe.reasons[1].startswith("could not read gpu_health: line 1 is not nvidia-smi")
    assert probe.reasons[2].startswith("could not read gpus: query-gpu line 1")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_mangled_node_outputs_inside_a_document_give_a_verdict(data: st.DataObject) -> None:
    document = _document(
        kernel_log={"exit_code": 0, "stdout": _mangled(data, DMESG[2], _NUMBERS), "stderr": ""},
        gpu_health={
            "exit_code": 0,
            "stdout": _mangled(data, data.draw(st.sampled_from(QUERY_SAMPLES)), _NUMBERS),
            "stderr": "",
        },
        gpus={"exit_code": 0, "stdout": _mangled(data, ROWS_SAMPLES[0], _NUMBERS), "stderr": ""},
        compute_apps={
            "exit_code": 0,
            "stdout": _mangled(data, APPS_SAMPLES[0], _NUMBERS),
            "stderr": "",
        },
    )
    _check_verdict(_interpret(json.dumps(document)))


# -- the XID catalog ------------------------------------------------------------------------------

CATALOG_TEXT = (Path(__file__).parent.parent / "daemon" / "evidence" / CATALOG_RESOURCE).read_text()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
@example(data=None)
def test_a_mangled_catalog_loads_or_is_a_catalog_error(data: st.DataObject | None) -> None:
    if data is None:  # a count threshold past what int() reads
        text = CATALOG_TEXT.replace('"count_threshold": 1', '"count_threshold": ' + "9" * 5000, 1)
    else:
        text = _mangled(data, CATALOG_TEXT, '{}[]":,0123456789²truefalsenull')
    try:
        catalog = parse_catalog(text)
    except XidCatalogError:
        return
    assert all(1 <= code <= 1023 for code in catalog.entries)
