"""The sweep's rhythm: each node at its own stable moment of the interval, the fleet spread over
it, every node due exactly once per interval, and a first start probing nobody at once."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from daemon.fleet.schedule import due_nodes, latest_moment, offset_s

INTERVAL_S = 900.0
CYCLE_S = 10.0
START = datetime(2026, 11, 24, 6, 0, 3, tzinfo=UTC)
FLEETS = {
    "numbered": [f"gpu-{n:04d}" for n in range(1, 1001)],
    "bare": [f"node{n:03d}" for n in range(1000)],
    "racks": [f"a100-r{rack:02d}-n{slot:02d}" for rack in range(40) for slot in range(25)],
}


@pytest.mark.parametrize("fleet", sorted(FLEETS))
def test_a_thousand_nodes_spread_over_the_interval(fleet: str) -> None:
    names = FLEETS[fleet]
    tenths = Counter(int(offset_s(name, 3600.0) // 360.0) for name in names)
    assert set(tenths) == set(range(10))
    # 10% of the fleet per tenth on average; never more than a few percent over that.
    assert max(tenths.values()) <= 130
    assert min(tenths.values()) >= 70
    hundredths = Counter(int(offset_s(name, 3600.0) // 36.0) for name in names)
    assert max(hundredths.values()) <= 30  # 10 on average: never a burst


def test_offsets_are_stable_and_scale_with_the_interval() -> None:
    names = FLEETS["numbered"][:50]
    first = [offset_s(name, INTERVAL_S) for name in names]
    assert first == [offset_s(name, INTERVAL_S) for name in names]
    assert all(0 <= offset < INTERVAL_S for offset in first)
    doubled = [offset_s(name, 2 * INTERVAL_S) for name in names]
    assert doubled == pytest.approx([2 * offset for offset in first])
    assert len(set(first)) == len(names)


def test_latest_moment_is_the_offset_into_the_current_interval() -> None:
    node = "gpu-0042"
    now = datetime(2026, 11, 24, 12, 34, 56, tzinfo=UTC)
    moment = latest_moment(node, now, INTERVAL_S)
    assert now - timedelta(seconds=INTERVAL_S) < moment <= now
    assert (moment.timestamp() % INTERVAL_S) == pytest.approx(offset_s(node, INTERVAL_S))
    assert latest_moment(node, moment + timedelta(milliseconds=1), INTERVAL_S) == moment
    assert latest_moment(node, moment - timedelta(seconds=1), INTERVAL_S) == moment - timedelta(
        seconds=INTERVAL_S
    )


def simulate(names: list[str], intervals: int) -> dict[str, list[datetime]]:
    """The daemon's cycles every CYCLE_S from START: the due nodes checked at once."""
    last: dict[str, datetime] = {}
    checked: dict[str, list[datetime]] = {name: [] for name in names}
    cycles = int(intervals * INTERVAL_S / CYCLE_S)
    for cycle in range(cycles + 1):
        now = START + timedelta(seconds=cycle * CYCLE_S)
        for node in due_nodes(names, last, now=now, interval_s=INTERVAL_S, started=START):
            last[node] = now
            checked[node].append(now)
    return checked


def test_each_node_is_due_exactly_once_per_interval_at_its_moment() -> None:
    names = FLEETS["racks"][:300]
    checked = simulate(names, intervals=3)
    assert {len(times) for times in checked.values()} == {3}
    for node, times in checked.items():
        for at in times:
            late = (at - latest_moment(node, at, INTERVAL_S)).total_seconds()
            assert 0 <= late < CYCLE_S
        gaps = {(later - earlier).total_seconds() for earlier, later in pairwise(times)}
        assert all(abs(gap - INTERVAL_S) <= CYCLE_S for gap in gaps)


def test_a_first_start_does_not_make_the_fleet_due_at_once() -> None:
    names = FLEETS["numbered"]
    assert due_nodes(names, {}, now=START, interval_s=INTERVAL_S, started=START) == []
    tenth_in = START + timedelta(seconds=INTERVAL_S / 10)
    early = due_nodes(names, {}, now=tenth_in, interval_s=INTERVAL_S, started=START)
    assert 50 <= len(early) <= 150
    whole = START + timedelta(seconds=INTERVAL_S)
    assert due_nodes(names, {}, now=whole, interval_s=INTERVAL_S, started=START) == names


def test_a_node_new_to_an_old_sweep_is_due_at_once_and_the_others_keep_their_rhythm() -> None:
    now = START + timedelta(days=3)
    last = {"gpu-0001": now - timedelta(seconds=1), "gpu-0002": now - timedelta(seconds=1)}
    due = due_nodes(
        ["gpu-0001", "gpu-0002", "gpu-0999"],
        last,
        now=now,
        interval_s=INTERVAL_S,
        started=START,
    )
    assert due == ["gpu-0999"]


def test_a_restart_keeps_each_nodes_moment() -> None:
    """Due-ness of a checked node depends on its last check, not on when the daemon started."""
    names = FLEETS["bare"][:200]
    now = START + timedelta(hours=5, seconds=17)
    last = {name: now - timedelta(seconds=INTERVAL_S / 2) for name in names}
    before = due_nodes(names, last, now=now, interval_s=INTERVAL_S, started=START)
    after = due_nodes(names, last, now=now, interval_s=INTERVAL_S, started=now)
    assert before == after
    assert 0 < len(before) < len(names)
