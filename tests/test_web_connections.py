"""Connections to `slurm-medic web`: one peer cannot take the server from everyone else.

The real server runs as a subprocess on a seeded SQLite record (tests/web_support.py), on a
unix socket under /tmp or on loopback. One peer (root's uid) opens more idle connections
than its cap: the ones over it are answered 503 at once, and another peer (bob, on the socket
or over loopback from the same address) is served all the while; over loopback a peer is the
uid owning the client's socket, so root gains nothing from another 127.x address. With the
total cap taken by root and bob, alice waits for a slot to free. A connection that sends no
whole request is closed after the read timeout, trickling or not; keep-alive and requests per
connection end too. With the server's descriptor limit lowered under it (prlimit), its log
says so in a line or two with a count, never a line per failed accept, and it serves again
once descriptors are free. The pieces (the guard's counts, the peer's key, the throttled log,
the loop's handler, the settings) are checked on their own first.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import selectors
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.config import ConfigError, load_settings
from daemon.web.connections import (
    AcceptErrors,
    ConnectionGuard,
    LoopbackOwners,
    ThrottledLog,
    connection_budget,
    diag_request,
    diag_uid,
    peer_key,
)
from daemon.web.identity import Peer, PeerCredentials
from daemon.web.settings import WebSettings
from tests.web_support import (
    MEDIC,
    WebProcess,
    free_port,
    held_as,
    request,
    request_as,
    stop,
    web_process,
    web_record_at,
)

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

PER_PEER = 64  # the default cap, which the first tests run under
IDLE = 200  # one peer's idle connections: more than its cap
POLL_S = 30.0  # the bound of every wait on the server; none is a timing assertion
HELD = "read_timeout_s = 120\n"  # long enough that idle connections stay for the test


# ---------------------------------------------------------------- the pieces


def test_the_defaults_are_1024_in_all_and_64_per_peer() -> None:
    web = WebSettings()
    assert (web.max_connections, web.max_connections_per_peer) == (1024, 64)
    assert web.read_timeout_s == 5.0


@pytest.mark.parametrize(
    ("section", "option"),
    [
        ("max_connections = 10\nmax_connections_per_peer = 11", "web.max_connections_per_peer"),
        ("max_connections = 0", "web.max_connections"),
        ("max_connections_per_peer = 0", "web.max_connections_per_peer"),
        ("read_timeout_s = 0", "web.read_timeout_s"),
        ("keep_alive_s = 0", "web.keep_alive_s"),
        ("max_requests_per_connection = 0", "web.max_requests_per_connection"),
    ],
)
def test_a_bad_connection_setting_is_refused_by_name(
    tmp_path: Path, section: str, option: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"[web]\n{section}\n")
    with pytest.raises(ConfigError, match=option):
        load_settings(config)


def test_the_guard_caps_each_peer_and_all_and_frees_a_slot_on_release() -> None:
    guard = ConnectionGuard(total=5, per_peer=3, read_timeout_s=5.0, max_requests=10)
    assert [guard.admit("uid 0") for _ in range(4)] == [True, True, True, False]
    assert [guard.admit("uid 1002") for _ in range(3)] == [True, True, False]  # total: 5
    guard.release("uid 0")
    assert guard.admit("uid 1002")
    assert not guard.admit("uid 1001")
    assert (guard.in_all, dict(guard.open)) == (5, {"uid 0": 2, "uid 1002": 3})


def test_a_peer_is_its_uid_its_address_or_its_ipv6_64() -> None:
    assert peer_key(Peer(unix=True, credentials=PeerCredentials(pid=9, uid=1002, gid=1))) == (
        "uid 1002"
    )
    assert peer_key(Peer(unix=True)) == "uid ?"
    assert peer_key(Peer(unix=False, address="127.0.0.2"), owner_uid=1002) == "uid 1002"
    assert peer_key(Peer(unix=False, address="127.0.0.2")) == "127.0.0.2"
    assert peer_key(Peer(unix=False, address="::ffff:10.1.2.3")) == "10.1.2.3"
    assert peer_key(Peer(unix=False, address="2001:db8::1")) == peer_key(
        Peer(unix=False, address="2001:db8::ffff:1")
    )
    assert peer_key(Peer(unix=False, address="2001:db8::1")) == "2001:db8::/64"


def test_the_kernels_answer_names_the_owner_of_the_clients_socket() -> None:
    asked = diag_request(socket.AF_INET, ("127.0.0.2", 40000), ("127.0.0.1", 8765), sequence=7)
    assert len(asked) == 16 + 56  # nlmsghdr, inet_diag_req_v2
    assert asked[16 + 8 : 16 + 12] == bytes([0x9C, 0x40, 0x22, 0x3D])  # ports, network order
    assert asked[16 + 12 : 16 + 16] == bytes([127, 0, 0, 2])  # the source: the client
    header = struct.pack("=IHHII", 16 + 72, 20, 0, 7, 0)
    answer = header + bytes(64) + struct.pack("=II", 1002, 12345)
    assert diag_uid(answer, sequence=7) == 1002
    assert diag_uid(answer, sequence=8) is None  # an answer to another question
    error = struct.pack("=IHHII", 16 + 20, 2, 0, 7, 0) + struct.pack("=i", -2) + bytes(16)
    assert diag_uid(error, sequence=7) is None  # no such socket: the client has gone


class _Accepted(asyncio.BaseTransport):
    """What asyncio's transport says of an accepted socket, for `LoopbackOwners`."""

    def __init__(self, connection: socket.socket) -> None:
        super().__init__()
        self.connection = connection

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        extra = {
            "socket": self.connection,
            "peername": self.connection.getpeername(),
            "sockname": self.connection.getsockname(),
        }
        return extra.get(name, default)


def test_the_kernel_names_the_owner_of_a_loopback_client_and_its_absence_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_connection(listener.getsockname()),
    ):
        accepted, (address, _port) = listener.accept()
        with accepted:
            peer = Peer(unix=False, address=address)
            owners = LoopbackOwners()
            assert owners.uid_of(_Accepted(accepted), peer) == os.getuid()
            owners.close()

            def no_netlink(*_args: object) -> socket.socket:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

            monkeypatch.setattr(socket, "socket", no_netlink)
            blocked = LoopbackOwners()
            with caplog.at_level(logging.WARNING, logger="slurm_medic.web"):
                assert blocked.uid_of(_Accepted(accepted), peer) is None
                assert blocked.uid_of(_Accepted(accepted), peer) is None
    assert len(caplog.records) == 1
    assert "count by address" in caplog.records[0].getMessage()


def test_the_total_leaves_room_below_the_descriptor_limit() -> None:
    assert connection_budget(1024, 524288) == 1024
    assert connection_budget(1024, 1024) == 1024 - 224
    assert connection_budget(1024, 100) == 0


def test_a_flood_is_one_line_per_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    throttled = ThrottledLog("thing failed", interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="slurm_medic.web"):
        for step in range(1000):  # a failure every 20 ms for 20 s
            now[0] = step * 0.02
            throttled.count(f"attempt {step}")
        throttled.flush()
    counts = [record.__dict__["fields"]["count"] for record in caplog.records]
    assert counts == [1, 500, 499]
    assert caplog.records[-1].getMessage().endswith("(latest: attempt 999)")


def test_the_loops_handler_counts_accept_errors_and_passes_on_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = AcceptErrors()
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(100):
                handler(
                    loop,
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                    },
                )
            handler(loop, {"message": "something else", "exception": RuntimeError("boom")})
    finally:
        loop.close()
    lines = [(record.name, record.getMessage()) for record in caplog.records]
    assert [name for name, _ in lines] == ["slurm_medic.web", "asyncio"]
    assert "something else" in lines[1][1]


# ---------------------------------------------------------------- the real server


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory under /tmp that bob may enter (pytest's own are root's, mode 0700), and
    short enough for a socket's path."""
    with tempfile.TemporaryDirectory(prefix="medic-web-", dir="/tmp") as directory:
        os.chmod(directory, 0o755)  # bob must reach the socket; nothing else is in it
        yield Path(directory)


def _answered_at_once(connections: list[socket.socket], expected: int) -> list[socket.socket]:
    """The connections with something to read (the server's refusals: nobody sent anything),
    polled until `expected` of them are or the bound passes."""
    with selectors.DefaultSelector() as selector:
        for connection in connections:
            selector.register(connection, selectors.EVENT_READ, connection)
        ready: list[socket.socket] = []
        deadline = time.monotonic() + POLL_S
        while len(ready) < expected and time.monotonic() < deadline:
            ready = [key.data for key, _ in selector.select(timeout=0.2)]
        return ready


def _read_to_end(connection: socket.socket) -> bytes:
    """All the server sends until it closes (bounded by the socket's timeout)."""
    chunks = []
    while chunk := connection.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _served_again(web: WebProcess, *, source: str | None = None) -> bool:
    """Whether a fresh connection is answered 200, polled within the bound (the server
    learns of closed connections a moment after they close)."""
    deadline = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        try:
            with web.connect(source=source, timeout_s=5) as connection:
                if request(connection, "/healthz")[0] == 200:
                    return True
        except (OSError, ValueError):  # refused: a 503 then the close, or the close alone
            pass
        time.sleep(0.1)
    return False


def _close(connections: list[socket.socket]) -> None:
    for connection in connections:
        connection.close()


def _lines(web: WebProcess, start: str) -> list[dict[str, Any]]:
    return [entry for entry in web.entries() if str(entry.get("msg", "")).startswith(start)]


def test_one_uid_over_its_cap_is_refused_and_bob_is_served(
    tmp_path: Path, socket_dir: Path
) -> None:
    with (
        web_record_at(tmp_path, web_extra=HELD) as record,
        web_process(record.config, tmp_path, path=socket_dir / "web.sock") as web,
    ):
        assert web.path is not None
        connections = [web.connect() for _ in range(IDLE)]
        try:
            refused = _answered_at_once(connections, IDLE - PER_PEER)
            assert len(refused) == IDLE - PER_PEER
            assert all(_read_to_end(c).startswith(b"HTTP/1.1 503 ") for c in refused)
            # Root holds its 64 idle connections; bob, another uid, is served, as himself.
            status, page = request_as("bob", "/", path=web.path)
            assert status == 200
            assert '<span class="who">bob</span>' in page
            # The 64 root holds were admitted: each answers a request.
            held = [c for c in connections if c not in refused]
            assert [request(c, "/healthz")[0] for c in held] == [200] * PER_PEER
        finally:
            _close(connections)
        assert _served_again(web)  # root's slots came back when it closed them
        stop(web)
        refusals = _lines(web, "refused connections over the cap")
        assert 1 <= len(refusals) <= 3
        assert sum(entry["count"] for entry in refusals) >= IDLE - PER_PEER


def test_over_loopback_a_peer_is_its_uid_whatever_its_address(tmp_path: Path) -> None:
    """Root floods the port from 127.0.0.1; bob, from the same address, is served; root
    from another loopback address gains nothing."""
    with (
        web_record_at(tmp_path, trusted_proxies="127.0.0.0/8", web_extra=HELD) as record,
        web_process(record.config, tmp_path, port=free_port()) as web,
    ):
        assert web.port is not None
        connections = [web.connect(source="127.0.0.1") for _ in range(IDLE)]
        try:
            refused = _answered_at_once(connections, IDLE - PER_PEER)
            assert len(refused) == IDLE - PER_PEER
            status, page = request_as("bob", "/", port=web.port, headers=record.headers("bob"))
            assert status == 200
            assert '<span class="who">bob</span>' in page
            with web.connect(source="127.0.0.2") as elsewhere:
                assert _read_to_end(elsewhere).startswith(b"HTTP/1.1 503 ")
        finally:
            _close(connections)
        stop(web)
        assert any("uid 0 holds 64" in entry["msg"] for entry in _lines(web, "refused"))


def test_the_total_cap_holds_and_a_slot_freed_serves_the_next(
    tmp_path: Path, socket_dir: Path
) -> None:
    caps = "max_connections = 10\nmax_connections_per_peer = 6\n" + HELD
    with (
        web_record_at(tmp_path, web_extra=caps) as record,
        web_process(record.config, tmp_path, path=socket_dir / "web.sock") as web,
    ):
        assert web.path is not None
        mine = [web.connect() for _ in range(6)]
        try:
            with held_as("bob", web.path, 4):  # 10 open: all there are
                assert request_as("alice", "/healthz", path=web.path)[0] == 503
                _close(mine)
                assert _served_as("alice", web.path)
        finally:
            _close(mine)


def _served_as(user: str, path: Path) -> bool:
    """Whether `user` is answered 200, polled within the bound."""
    deadline = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        if request_as(user, "/healthz", path=path)[0] == 200:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebProcess]:
    """A server on loopback that waits 1 s for a request and keeps a connection for 3."""
    work = tmp_path_factory.mktemp("web-impatient")
    limits = "read_timeout_s = 1\nkeep_alive_s = 1\nmax_requests_per_connection = 3\n"
    with (
        web_record_at(work, web_extra=limits) as record,
        web_process(record.config, work, port=free_port()) as web,
    ):
        yield web


def test_a_connection_that_sends_nothing_is_closed(impatient: WebProcess) -> None:
    with impatient.connect(timeout_s=POLL_S) as idle:
        assert _read_to_end(idle) == b""  # closed without a word, within the bound


def test_a_request_head_trickled_in_is_closed_all_the_same(impatient: WebProcess) -> None:
    with impatient.connect(timeout_s=POLL_S) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: slurm-medic\r\n")
        slow.setblocking(False)
        closed, answered = False, b""
        for step in range(int(POLL_S / 0.1)):  # a header line every 100 ms, never the end
            try:
                chunk = slow.recv(1024)
                answered += chunk
                if chunk == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            try:
                slow.sendall(b"X-Step-%d: x\r\n" % step)
            except OSError:  # reset: the server closed it
                closed = True
                break
            time.sleep(0.1)
        assert closed
        assert answered == b""  # closed for its slowness, not answered for its size


def test_an_idle_keep_alive_connection_is_closed(impatient: WebProcess) -> None:
    with impatient.connect(timeout_s=POLL_S) as kept:
        assert request(kept, "/healthz")[0] == 200
        assert _read_to_end(kept) == b""


def test_a_connection_closes_after_its_requests_per_connection(impatient: WebProcess) -> None:
    with impatient.connect(timeout_s=POLL_S) as connection:
        answers = [request(connection, "/healthz") for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert [headers.get("connection") for _, headers, _ in answers] == [None, None, "close"]
        assert _read_to_end(connection) == b""


def test_out_of_descriptors_the_log_says_so_briefly_and_the_server_recovers(
    tmp_path: Path, socket_dir: Path
) -> None:
    with (
        web_record_at(tmp_path, web_extra=HELD) as record,
        web_process(record.config, tmp_path, path=socket_dir / "web.sock") as web,
    ):
        # The server raised its limit at start; lower it now to a few more than it holds.
        in_use = len(os.listdir(f"/proc/{web.process.pid}/fd"))
        resource.prlimit(web.process.pid, resource.RLIMIT_NOFILE, (in_use + 6, in_use + 6))
        connections = [web.connect() for _ in range(40)]  # under the caps: only fds run out
        try:
            deadline = time.monotonic() + POLL_S
            while not _lines(web, "accepting a connection failed"):
                assert time.monotonic() < deadline, web.log_tail()
                time.sleep(0.1)
            # asyncio tries again every second, each time failing for every waiting connect.
            for _ in range(20):
                time.sleep(0.1)
        finally:
            _close(connections)
        assert _served_again(web)
        stop(web)
        failures = _lines(web, "accepting a connection failed")
        assert 1 <= len(failures) <= 3, failures
        assert sum(entry["count"] for entry in failures) > len(failures)
        assert not _lines(web, "socket.accept() out of system resource")
        assert len(web.entries()) < 100, web.log_tail()


def test_the_server_raises_its_descriptor_limit_and_keeps_the_total_below_it(
    tmp_path: Path,
) -> None:
    with (
        web_record_at(tmp_path) as record,
        web_process(record.config, tmp_path, port=free_port(), nofile=(256, 400)) as web,
    ):
        limits = Path(f"/proc/{web.process.pid}/limits").read_text()
        (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
        assert line.split()[3:5] == ["400", "400"]  # soft raised to the hard limit
    (warning,) = _lines(web, "web.max_connections is 1024")
    assert warning["msg"].endswith("the descriptor limit (400) leaves room for 176")


def test_a_descriptor_limit_with_no_room_for_connections_stops_the_server(
    tmp_path: Path,
) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("SUDO_")}
    where = ["--listen", f"127.0.0.1:{free_port()}"]
    with web_record_at(tmp_path) as record:
        done = subprocess.run(
            [
                "prlimit",
                "--nofile=200:200",
                str(MEDIC),
                "web",
                "--config",
                str(record.config),
                *where,
            ],
            capture_output=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2
    assert b"slurm-medic web: the descriptor limit (200) leaves no room" in done.stderr
