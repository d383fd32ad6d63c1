"""The epilog hook and the daemon's listener over a real unix datagram socket."""

from __future__ import annotations

import os
import pwd
import queue
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.hook import HookError, HookListener, parse_job_id
from daemon.process import run

EPILOG = Path(__file__).parents[1] / "deploy" / "epilog" / "slurm-medic-epilog"
WAIT_S = 5.0


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short path (sun_path is 108 bytes) that other users may traverse."""
    directory = Path(tempfile.mkdtemp(prefix="hook-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _epilog(path: Path, job_id: str | None, *, prefix: tuple[str, ...] = ()) -> int:
    env = {"PATH": "/usr/bin:/bin", "SLURM_MEDIC_HOOK_SOCKET": str(path)}
    if job_id is not None:
        env["SLURM_JOB_ID"] = job_id
    # The interpreter of the shebang; a hang would be a CommandTimeout, not a slow pass.
    return run([*prefix, sys.executable, "-IS", str(EPILOG)], timeout=10, env=env).returncode


def _listen(path: Path, **kwargs: object) -> tuple[HookListener, queue.Queue[int]]:
    woken: queue.Queue[int] = queue.Queue()
    listener = HookListener(path, on_job=woken.put, **kwargs)  # type: ignore[arg-type]
    listener.start()
    return listener, woken


def _send(path: Path, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(data, str(path))


def test_the_epilog_wakes_the_listener_with_the_job_id(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    listener, woken = _listen(path)
    try:
        assert _epilog(path, "48213") == 0
        assert woken.get(timeout=WAIT_S) == 48213
        assert listener.stats.accepted == 1
    finally:
        listener.stop()
    assert not path.exists()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"0",
        b"-1",
        b"12; rm -rf /",
        b"12 13",
        b"\xff\xfe",
        "\uff11\uff12".encode(),
        b"9" * 20,
        b"1" * 100,
        b"12\n\n",
    ],
)
def test_anything_but_a_job_id_is_refused(socket_dir: Path, data: bytes) -> None:
    path = socket_dir / "hook.sock"
    listener, woken = _listen(path)
    try:
        _send(path, data)
        _send(path, b"7\n")  # datagrams arrive in order: once 7 is seen, the first was handled
        assert woken.get(timeout=WAIT_S) == 7
        assert woken.empty()
        assert (listener.stats.accepted, listener.stats.rejected) == (1, 1)
    finally:
        listener.stop()


def test_job_ids_parse_strictly() -> None:
    assert parse_job_id(b"123\n") == 123
    assert parse_job_id(b"9223372036854775808") is None  # 2**63: no Slurm job id
    assert parse_job_id(b"9223372036854775807") == 2**63 - 1
    assert parse_job_id(b" 123") is None


@given(st.binary(max_size=80))
def test_any_datagram_is_a_plain_job_id_or_nothing(data: bytes) -> None:
    job_id = parse_job_id(data)
    if job_id is not None:
        assert data.rstrip(b"\n") == str(job_id).encode()
        assert data.count(b"\n") <= 1


def test_only_allowed_senders_wake_it(socket_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("sending as another user needs root")
    try:
        alice = pwd.getpwnam("alice")
    except KeyError:
        pytest.skip("no local user alice")
    path = socket_dir / "hook.sock"
    listener, woken = _listen(path, allowed_uids={0})
    as_alice = (
        "setpriv",
        "--reuid",
        str(alice.pw_uid),
        "--regid",
        str(alice.pw_gid),
        "--clear-groups",
    )
    try:
        assert _epilog(path, "111", prefix=as_alice) == 0
        assert _epilog(path, "222") == 0
        assert woken.get(timeout=WAIT_S) == 222
        assert woken.empty()
        assert listener.stats.rejected == 1
    finally:
        listener.stop()


def test_the_epilog_never_fails_the_job(socket_dir: Path) -> None:
    missing = socket_dir / "nobody-listens.sock"
    assert _epilog(missing, "5") == 0
    assert _epilog(missing, None) == 0
    assert _epilog(missing, "5; reboot") == 0
    not_a_socket = socket_dir / "file"
    not_a_socket.write_text("x")
    assert _epilog(not_a_socket, "5") == 0


def _fill(path: Path) -> int:
    """Send to `path` until its receive queue is full; how many datagrams it took."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for sent in range(1_000_000):
            try:
                sender.sendto(b"1", str(path))
            except BlockingIOError:
                return sent
    raise AssertionError("the socket never filled")


def test_the_epilog_does_not_block_on_a_full_socket(socket_dir: Path) -> None:
    path = socket_dir / "full.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as deaf:
        deaf.bind(str(path))
        assert _fill(path) > 0
        assert _epilog(path, "5") == 0


def test_a_file_in_the_sockets_place_is_left_alone(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    path.write_text("someone's file")
    with pytest.raises(HookError, match="not a socket"):
        HookListener(path, on_job=lambda _job: None).start()
    assert path.read_text() == "someone's file"


def test_a_stale_socket_is_replaced(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stale:
        stale.bind(str(path))
    listener, woken = _listen(path)
    try:
        _send(path, b"99")
        assert woken.get(timeout=WAIT_S) == 99
        assert path.stat().st_mode & 0o777 == 0o666
    finally:
        listener.stop()
