"""Serving the metrics: the web server's /metrics (the record's numbers only, on a registry of
its own) and the daemon's listener (`[metrics] listen`: the record's numbers and the daemon's
own series, from a background thread started and stopped with the daemon's run)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import start_http_server
from starlette.concurrency import run_in_threadpool
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from daemon.metrics.record import DaemonLimits, OpenSession, RecordCollector
from daemon.metrics.series import IN_PROCESS
from daemon.metrics.settings import split_listen

STOP_TIMEOUT_S = 5.0
# The text format `generate_latest` writes, as Prometheus 2.x and every scraper read it.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class MetricsListenError(OSError):
    """The daemon's metrics address cannot be listened on (in use, not this host's)."""


def record_registry(open_session: OpenSession) -> CollectorRegistry:
    """The record's numbers alone: what any process that can read the record may export."""
    registry = CollectorRegistry(auto_describe=False)  # no read of the record until a scrape
    registry.register(RecordCollector(open_session))
    return registry


def daemon_registry(open_session: OpenSession, limits: DaemonLimits) -> CollectorRegistry:
    """The daemon's: the record's numbers with its limits, and its in-process series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RecordCollector(open_session, limits=limits))
    registry.register(IN_PROCESS)
    return registry


class MetricsEndpoint:
    """An ASGI app answering GET/HEAD with the exposition; the record is read in a worker
    thread, so a slow database never stalls the server's event loop. A class, not a
    function, so Starlette mounts it as an app (`Mount` or `Route`) whatever the path."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        response: Response
        if scope["method"] not in ("GET", "HEAD"):
            response = PlainTextResponse("GET only\n", status_code=405, headers={"Allow": "GET"})
        else:
            body = await run_in_threadpool(generate_latest, self._registry)
            response = Response(body, media_type=TEXT_FORMAT)
        await response(scope, receive, send)


def web_metrics_app(open_session: OpenSession) -> ASGIApp:
    """/metrics for the web server: the record collector only, on its own registry.
    `open_session` should make read-only sessions (`make_session_factory(engine,
    read_only=True)`): on SQLite they take no write lock, so a scrape never waits on a cycle."""
    return MetricsEndpoint(record_registry(open_session))


@contextmanager
def serve_metrics(listen: str, registry: CollectorRegistry) -> Iterator[tuple[str, int]]:
    """Serve `registry` on `listen` (HOST:PORT; port 0 picks one) from a background thread
    while the block runs; yields the address bound."""
    host, port = split_listen(listen)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise MetricsListenError(
            error.errno, f"cannot serve metrics on {listen}: {error.strerror or error}"
        ) from error
    try:
        yield _bound(server)
    finally:
        _stop(server, thread)


def _bound(server: WSGIServer) -> tuple[str, int]:
    address = server.server_address
    return str(address[0]), int(address[1])


def _stop(server: WSGIServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=STOP_TIMEOUT_S)
