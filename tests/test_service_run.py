"""`slurm-medic run` as a process: a bad config exits 2 naming the option, an old schema
exits 3, and SIGTERM stops a running daemon cleanly after telling systemd READY=1."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.store.engine import make_engine
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url

CLI = str(Path(sys.executable).parent / "slurm-medic")


def config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'hook_socket = "{tmp_path}/hook.sock"\n'
        f'[store]\nurl = "{sqlite_url(tmp_path / "medic.db")}"\n' + extra
    )
    return path


def test_a_bad_option_exits_2_naming_it(tmp_path: Path) -> None:
    path = config(tmp_path, "[watcher]\npoll_interval_s = 0\n")
    result = subprocess.run(
        [CLI, "run", "--once", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "watcher.poll_interval_s" in result.stderr


def test_a_probe_key_others_may_read_exits_2_before_anything_runs(tmp_path: Path) -> None:
    key, known_hosts = tmp_path / "probe_key", tmp_path / "known_hosts"
    key.write_text("not read: refused first")
    key.chmod(0o644)
    known_hosts.write_text("")
    probe = f'[probe]\nkey_path = "{key}"\nknown_hosts_path = "{known_hosts}"\n'
    result = subprocess.run(
        [CLI, "run", "--once", "--config", str(config(tmp_path, probe))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert f"the probe key {key} has mode 0644: group or others may read" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_empty_record_exits_3_and_says_how_to_upgrade(tmp_path: Path) -> None:
    result = subprocess.run(
        [CLI, "run", "--once", "--config", str(config(tmp_path))],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    assert "slurm-medic db upgrade" in result.stderr


@pytest.mark.cluster
@pytest.mark.usefixtures("devcluster")
def test_sigterm_stops_the_daemon_after_ready(tmp_path: Path) -> None:
    path = config(tmp_path, "[watcher]\npoll_interval_s = 1\n")
    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    upgrade(engine)
    engine.dispose()
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(notify))
        sock.settimeout(60)
        daemon = subprocess.Popen(
            [CLI, "run", "--config", str(path)],
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin", "NOTIFY_SOCKET": str(notify)},
        )
        assert sock.recv(64) == b"READY=1"
        assert (tmp_path / "hook.sock").is_socket()
        time.sleep(2)  # let a cycle or two run
        daemon.send_signal(signal.SIGTERM)
        _out, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    messages = [line["msg"] for line in lines]
    assert "cycle" in messages
    assert any(message.startswith("signal 15") for message in messages)
    assert not (tmp_path / "hook.sock").exists()
