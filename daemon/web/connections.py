"""Connections to `slurm-medic web`: how many each peer may hold, how long one may idle, and
what the log says when the server runs out of file descriptors.

One ordinary user once opened about 4,000 idle connections: the server ran out of
descriptors, everyone else's requests timed out, and asyncio logged every failed accept
(388 MB in 45 s). So:

- `GuardedProtocol` counts connections per peer (a uid on the unix socket; an address over
  TCP, an IPv6 one by its /64) and in all, as each is accepted and before uvicorn or the app
  sees it: one over a cap is answered 503 and closed at once. Over loopback TCP the peer is
  the uid that owns the client's socket (`LoopbackOwners`, the kernel's sock_diag): a local
  user who connects to the port directly counts as themself from whatever 127.x address, not
  as the proxy on the same host, whose share they could otherwise fill.
- A connection has `read_timeout_s` to deliver a whole request, from its opening or its last
  answer: one that sends nothing, or trickles its head or body, is closed. uvicorn's
  keep-alive timeout closes an idle one between requests, and after
  `max_requests_per_connection` answers the last says `Connection: close`.
- `raise_descriptor_limit` lifts RLIMIT_NOFILE to its hard limit at start and
  `connection_budget` keeps the total cap below it, with room for the record's connections.
- `AcceptErrors`, the loop's exception handler, makes asyncio's line per failed accept one
  line per interval with a count (asyncio itself tries again a second later, so the server
  serves again once descriptors are free). Refusals over a cap are logged the same way.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.server import Server, ServerState

from daemon.web.identity import Peer, PeerCredentialsProtocol, peer_of
from daemon.web.settings import WebSettings

log = logging.getLogger("slurm_medic.web")

# A flood of failed accepts or refusals is one line per this many seconds, with its count.
LOG_INTERVAL_S = 10.0
# Descriptors never given to connections: stdio, the listener, the loop's, imports and
# passwd/group lookups (64), and the record's: up to 40 requests at once in Starlette's thread
# pool, each on its own engine (SQLite's file, -wal and -shm; PostgreSQL's socket), 4 each.
RESERVED_DESCRIPTORS = 64 + 40 * 4
# Connections the kernel queues before they are accepted, and so the accepts asyncio tries
# per wake-up: a burst this big waits; beyond it a connect is refused (unix) or its SYN
# dropped (TCP), never held where no cap counts it.
BACKLOG = 256
# What asyncio's accept loop reports as "out of system resource".
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_REFUSAL_BODY = b"slurm-medic web: too many open connections; close some and retry\n"
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(_REFUSAL_BODY) + _REFUSAL_BODY
)
_CLOSE_HEADER = (b"connection", b"close")


class ThrottledLog:
    """One line per `interval_s` for what can happen thousands of times a second: the first
    at once, then the count since the line before; `flush` says what is left."""

    def __init__(
        self,
        what: str,
        *,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.interval_s = interval_s
        self._clock = clock
        self._pending = 0
        self._last_line: float | None = None
        self._latest = ""

    def count(self, latest: str) -> None:
        self._pending += 1
        self._latest = latest
        now = self._clock()
        if self._last_line is None or now - self._last_line >= self.interval_s:
            self._line(now)

    def flush(self) -> None:
        if self._pending:
            self._line(self._clock())

    def _line(self, now: float) -> None:
        log.warning(
            "%s: %d since the last such line (latest: %s)",
            self.what,
            self._pending,
            self._latest,
            extra={"fields": {"count": self._pending, "interval_s": self.interval_s}},
        )
        self._pending = 0
        self._last_line = now


def peer_key(peer: Peer, *, owner_uid: int | None = None) -> str:
    """Whose slots a connection takes: a uid (the socket's peer, or `owner_uid`, the owner of
    a loopback client's socket), an IPv4 address, an IPv6 /64 (one host's usual share, so
    that rotating addresses within it gains nothing)."""
    if owner_uid is not None:
        return f"uid {owner_uid}"
    if peer.unix:
        return "uid ?" if peer.credentials is None else f"uid {peer.credentials.uid}"
    if peer.address is None:
        return "address ?"
    try:
        address = ipaddress.ip_address(peer.address)
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is not None:
                return str(address.ipv4_mapped)
            return str(ipaddress.ip_network(f"{address.exploded}/64", strict=False))
    except ValueError:
        return peer.address
    return str(address)


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): one request for one TCP socket.
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_DIAG_UID_AT = _NLMSG_HEADER.size + 64  # inet_diag_msg: 4 bytes, sockid (48), 3 x u32, uid
Address = tuple[str, int]


def diag_request(family: int, client: Address, server: Address, *, sequence: int) -> bytes:
    """The netlink message asking for the client's end of a TCP connection (its source is
    the client's address, its destination the server's)."""

    def packed(address: str) -> bytes:
        return socket.inet_pton(family, address).ljust(16, b"\0")

    sockid = (
        struct.pack("!HH", client[1], server[1])
        + packed(client[0])
        + packed(server[0])
        + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
    )
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, _ALL_STATES) + sockid
    header = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, sequence, 0
    )
    return header + body


def answers(reply: bytes, *, sequence: int) -> bool:
    """Whether the kernel's message answers question `sequence` (its uid, or its error)."""
    return len(reply) >= _NLMSG_HEADER.size and _NLMSG_HEADER.unpack_from(reply)[3] == sequence


def diag_uid(reply: bytes, *, sequence: int) -> int | None:
    """The socket owner's uid in the kernel's answer; None for an error (no such socket: the
    client has closed it) or an answer to another question."""
    if len(reply) < _DIAG_UID_AT + 4 or not answers(reply, sequence=sequence):
        return None
    if _NLMSG_HEADER.unpack_from(reply)[1] != SOCK_DIAG_BY_FAMILY:
        return None
    uid: int = struct.unpack_from("=I", reply, _DIAG_UID_AT)[0]
    return uid


def _is_loopback(address: str) -> bool:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped.is_loopback
    return parsed.is_loopback


class LoopbackOwners:
    """Who owns the client's socket of a loopback TCP connection, asked of the kernel
    (sock_diag netlink, answered within the call). Where the kernel will not say (no
    AF_NETLINK, as under a unit's RestrictAddressFamilies without it) it is said once and
    such peers count by address."""

    def __init__(self) -> None:
        self._netlink: socket.socket | None = None
        self._unavailable = False
        self._sequence = 0

    def uid_of(self, transport: asyncio.BaseTransport, peer: Peer) -> int | None:
        if peer.unix or peer.address is None or not _is_loopback(peer.address):
            return None
        connection = transport.get_extra_info("socket")
        client = transport.get_extra_info("peername")
        server = transport.get_extra_info("sockname")
        if connection is None or not isinstance(client, tuple) or not isinstance(server, tuple):
            return None
        netlink = self._open()
        if netlink is None:
            return None
        self._sequence = self._sequence % 0xFFFFFFFF + 1
        try:
            netlink.send(
                diag_request(
                    connection.family,
                    (client[0], client[1]),
                    (server[0], server[1]),
                    sequence=self._sequence,
                )
            )
            for _ in range(4):  # an answer to an earlier question that timed out is skipped
                reply = netlink.recv(4096)
                if answers(reply, sequence=self._sequence):
                    return diag_uid(reply, sequence=self._sequence)
        except OSError:
            return None
        return None

    def close(self) -> None:
        if self._netlink is not None:
            self._netlink.close()
            self._netlink = None

    def _open(self) -> socket.socket | None:
        if self._netlink is None and not self._unavailable:
            try:
                netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
                netlink.settimeout(1.0)
                netlink.connect((0, 0))
            except OSError as error:
                self._unavailable = True
                log.warning(
                    "cannot ask the kernel who owns a loopback connection (%s): loopback"
                    " connections count by address, the proxy's with any local user's",
                    error.strerror,
                )
                return None
            self._netlink = netlink
        return self._netlink


def connection_budget(
    wanted: int, descriptors: int, *, reserved: int = RESERVED_DESCRIPTORS
) -> int:
    """The total cap in force: `wanted`, or what the descriptor limit leaves after the
    reserve (0: none at all)."""
    return max(0, min(wanted, descriptors - reserved))


def raise_descriptor_limit() -> int:
    """RLIMIT_NOFILE's soft limit raised to the hard one (systemd gives a service 1024 and
    524288); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):
            return soft
        return hard
    return soft


@dataclass
class ConnectionGuard:
    """The connections open, per peer and in all, and the limits each one lives under.

    `admit` and `release` run on the event loop's one thread: plain counters suffice."""

    total: int
    per_peer: int
    read_timeout_s: float
    max_requests: int
    open: Counter[str] = field(default_factory=Counter)
    in_all: int = 0
    refusals: ThrottledLog = field(
        default_factory=lambda: ThrottledLog("refused connections over the cap")
    )
    owners: LoopbackOwners | None = None

    @classmethod
    def for_settings(cls, web: WebSettings, *, descriptors: int) -> ConnectionGuard:
        total = connection_budget(web.max_connections, descriptors)
        return cls(
            total=total,
            per_peer=min(web.max_connections_per_peer, total),
            read_timeout_s=web.read_timeout_s,
            max_requests=web.max_requests_per_connection,
            owners=LoopbackOwners(),
        )

    def key_of(self, transport: asyncio.BaseTransport, peer: Peer) -> str:
        owner = None if self.owners is None else self.owners.uid_of(transport, peer)
        return peer_key(peer, owner_uid=owner)

    def admit(self, peer: str) -> bool:
        if self.in_all >= self.total:
            self.refusals.count(f"{peer}; all {self.total} connections taken")
            return False
        if self.open[peer] >= self.per_peer:
            self.refusals.count(f"{peer} holds {self.per_peer}, its cap")
            return False
        self.open[peer] += 1
        self.in_all += 1
        return True

    def release(self, peer: str) -> None:
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]
        self.in_all -= 1


class GuardedProtocol(PeerCredentialsProtocol):
    """The peer-credentials protocol under a `ConnectionGuard`: capped at accept, closed when
    it keeps the server waiting for a request, and after so many answers."""

    guard: ClassVar[ConnectionGuard]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._peer: str | None = None  # None: refused, or already released
        self._read_timer: asyncio.TimerHandle | None = None
        self._requests = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = peer_of(transport)
        key = self.guard.key_of(transport, peer)
        if not self.guard.admit(key):
            # Never handed to uvicorn: its state and its concurrency count never see it.
            transport.write(REFUSAL)
            transport.close()
            return
        self._peer = key
        self.open_for(transport, peer)
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is None:
            return
        self.guard.release(self._peer)
        self._peer = None
        self._stop_read_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # a request's head was read
            self._requests += 1
            if self._requests >= self.guard.max_requests:
                self.cycle.keep_alive = False
                self.cycle.default_headers = [*self.cycle.default_headers, _CLOSE_HEADER]
        self._watch_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reading()

    def _watch_reading(self) -> None:
        """The read timer runs while the server waits on the client (for a request's head or
        its body), never while the app has the request."""
        waiting = self.conn.their_state in {h11.IDLE, h11.SEND_BODY}
        if not waiting or self.transport.is_closing():
            self._stop_read_timer()
        elif self._read_timer is None:
            self._read_timer = self.loop.call_later(self.guard.read_timeout_s, self._read_timed_out)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=`, bound to this server's guard."""

    class Bound(GuardedProtocol):
        pass

    Bound.guard = guard
    return Bound


class AcceptErrors:
    """The loop's exception handler. asyncio's accept loop, out of descriptors, takes the
    listener off for a second but reports each failed attempt (up to the backlog at every
    wake-up): those become `ThrottledLog` lines; anything else goes to asyncio's own handler."""

    def __init__(self) -> None:
        self.log = ThrottledLog("accepting a connection failed (out of descriptors)")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        message = str(context.get("message", ""))
        if (
            isinstance(error, OSError)
            and error.errno in ACCEPT_ERRNOS
            and message.startswith("socket.accept()")
        ):
            self.log.count(f"{error.strerror} (errno {errno.errorcode.get(error.errno or 0)})")
            return
        loop.default_exception_handler(context)


class GuardedServer(Server):
    """uvicorn's server with `AcceptErrors` on its loop; what the throttled lines have not
    said yet is said when it stops."""

    def __init__(self, config: Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard
        self.accept_errors = AcceptErrors()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.accept_errors)
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets=sockets)
        self.accept_errors.log.flush()
        self.guard.refusals.flush()
        if self.guard.owners is not None:
            self.guard.owners.close()
