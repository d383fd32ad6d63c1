"""Kernel log parsing on real published lines (tests/data/dmesg) and in a job's window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from daemon.evidence.kernel_log import TimeWindow, parse_kernel_log
from daemon.evidence.records import MAX_PID, XidPolicy
from daemon.evidence.xid import load_catalog

DATA = Path(__file__).parent / "data" / "dmesg"
CATALOG = load_catalog()
START = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
WINDOW = TimeWindow(START, START + timedelta(minutes=30), slack=timedelta(minutes=2))


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_journal_xid79_and_its_repeat_are_one_event() -> None:
    found = parse_kernel_log(read("open-gpu-kernel-modules-1151-xid79.txt"), catalog=CATALOG)
    (event,) = found.xid_events
    assert event.code == 79
    assert event.pci_bus_id == "0000:2b:00"
    assert event.policy is XidPolicy.HARDWARE
    assert event.meaning == "GPU has fallen off the bus"
    assert event.pid is None
    assert event.time is None  # syslog lines carry no year


def test_fallen_off_the_bus_without_xid_counts_as_79() -> None:
    found = parse_kernel_log(read("nvsentinel-155-fallen-off-bus.txt"), catalog=CATALOG)
    (event,) = found.xid_events
    assert (event.code, event.pci_bus_id) == (79, "0000:b3:00")


def test_xid63_with_pid() -> None:
    (event,) = parse_kernel_log(read("ml-engineering-xid63.txt"), catalog=CATALOG).xid_events
    assert (event.code, event.pid, event.pci_bus_id) == (63, 1896, "0000:10:1c")
    assert event.process_name is None


def test_memcg_oom_kill_is_one_record_marked_cgroup() -> None:
    found = parse_kernel_log(read("ltp-memcg-oom-kill.txt"), catalog=CATALOG)
    (kill,) = found.host_oom_kills
    assert (kill.pid, kill.process_name, kill.cgroup) == (19289, "memcg_process", True)
    assert found.xid_events == ()


def test_global_oom_kill_is_not_cgroup() -> None:
    text = (
        "2026-11-22T03:10:00,000001+00:00 Out of memory: Killed process 4242 (python3) "
        "total-vm:1234kB, anon-rss:99kB\n"
    )
    (kill,) = parse_kernel_log(text, catalog=CATALOG, window=WINDOW).host_oom_kills
    assert (kill.pid, kill.cgroup) == (4242, False)
    assert kill.time == datetime(2026, 11, 22, 3, 10, 0, 1, tzinfo=UTC)


def test_window_keeps_only_lines_inside_with_slack() -> None:
    lines = [
        "2026-11-22T02:57:59,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen",
        "2026-11-22T02:58:01,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 48, pid=2, DBE",
        "2026-11-22T03:31:59,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 94, pid=3, Contained",
        "2026-11-22T03:32:01,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 95, pid=4, Uncontained",
    ]
    found = parse_kernel_log("\n".join(lines), catalog=CATALOG, window=WINDOW)
    assert [event.code for event in found.xid_events] == [48, 94]
    assert (found.lines_read, found.lines_in_window) == (4, 2)


def test_journalctl_short_iso_lines() -> None:
    text = (
        "2026-11-22T03:05:00+0000 gpu-03 kernel: "
        "NVRM: Xid (PCI:0000:47:00): 45, pid=9, name=python3, Ch 00000008\n"
    )
    (event,) = parse_kernel_log(text, catalog=CATALOG, window=WINDOW).xid_events
    assert (event.code, event.pid, event.process_name) == (45, 9, "python3")
    assert event.policy is XidPolicy.APPLICATION


def test_lines_without_time_are_kept_with_a_note_when_a_window_is_asked() -> None:
    found = parse_kernel_log(read("ml-engineering-xid63.txt"), catalog=CATALOG, window=WINDOW)
    assert len(found.xid_events) == 1
    assert found.notes == ("kernel log lines carry no wall-clock time: the window was not applied",)


def test_real_iso_format_from_this_machine_has_no_findings() -> None:
    found = parse_kernel_log(read("local-dmesg-iso.txt"), catalog=CATALOG)
    assert (found.xid_events, found.host_oom_kills, found.lines_read) == ((), (), 3)


@given(st.text(max_size=500))
def test_any_text_parses_without_error(text: str) -> None:
    found = parse_kernel_log(text, catalog=CATALOG, window=WINDOW)
    assert found.lines_in_window <= found.lines_read


@given(
    st.integers(1, 200), st.integers(0, MAX_PID), st.text(alphabet="abcdefgh_ 0123", max_size=15)
)
def test_any_xid_line_round_trips(code: int, pid: int, name: str) -> None:
    line = (
        "2026-11-22T03:10:00,5+00:00 "
        f"NVRM: Xid (PCI:0000:3b:00): {code}, pid={pid}, name={name}, x\n"
    )
    (event,) = parse_kernel_log(line, catalog=CATALOG, window=WINDOW).xid_events
    assert (event.code, event.pid) == (code, pid)
    assert event.process_name == (name.strip() or None)
    assert event.policy is CATALOG.entry(code).policy
