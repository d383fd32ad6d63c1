"""The end-to-end harness's crash: `Medic.kill` ends the daemon's whole tree, as systemd does.

The daemon runs every tool in its own session (daemon/process.py), so a kill of its process
group alone left a crash test's paused `sbatch` wrapper alive, to submit a stray job later.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.e2e import Medic, children

GONE_WITHIN_S = 10


def alive(pid: int) -> bool:
    """Running, stopped or sleeping; a zombie (killed, not yet reaped) is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_kill_ends_children_that_left_the_daemons_session(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    medic = Medic(tmp_path, probe={})
    # A "daemon" whose child runs in its own session, as daemon/process.py starts sbatch.
    medic.daemon = subprocess.Popen(
        ["bash", "-c", f"setsid bash -c 'sleep 1; touch {marker}' & wait"],
        start_new_session=True,
    )
    deadline = time.monotonic() + GONE_WITHIN_S
    while not (session_child := children(medic.daemon.pid)):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)

    assert medic.kill() == -9
    while any(map(alive, session_child)):
        assert time.monotonic() < deadline, "the child in its own session outlived the kill"
        time.sleep(0.05)
    time.sleep(1.5)  # past the child's own sleep: had any of it survived, it would have run on
    assert not marker.exists()
