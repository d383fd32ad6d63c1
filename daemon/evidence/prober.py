"""The probe runner: fetch each node's probe document over SSH, judge it per job window.

One fetch per node per cycle however many failed jobs ran there: requests are grouped by
node, fetched concurrently (bounded), and the raw document is cached for a short TTL, so
the next job on the same node in the same cycle reuses it. Judging is pure
(`daemon.evidence.probe`); only the fetch touches the network, through `daemon.ssh`.
A node that cannot be fetched is `unreachable` with the reason: never healthy.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from daemon.evidence.kernel_log import TimeWindow
from daemon.evidence.nvidia_smi import MIB
from daemon.evidence.probe import interpret_probe, unreachable
from daemon.evidence.records import NodeProbe
from daemon.evidence.xid import XidCatalog, XidCatalogError, XidOverride, load_catalog
from daemon.metrics.series import ProbeFailure, probe_fetched
from daemon.ssh import (
    HostKeyMismatch,
    RemoteResult,
    SshCredentials,
    SshError,
    SshTarget,
    UnknownHostKey,
    check_private_key,
    run_remote,
)

log = logging.getLogger(__name__)

PROBE_COMMAND = "medic-node-probe"
# Host names and addresses only: a node name reaches paramiko as a host, never a shell.
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}\Z")


class ProbeSettings(BaseModel):
    """How the daemon reaches nodes and judges what it finds; validated at start-up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_path: Path
    known_hosts_path: Path
    user: Annotated[str, StringConstraints(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")] = "medic"
    port: int = Field(default=22, ge=1, le=65535)
    connect_timeout_s: float = Field(default=10.0, gt=0, le=300)
    command_timeout_s: float = Field(default=45.0, gt=0, le=900)
    max_output_bytes: int = Field(default=32 * MIB, ge=64 * 1024, le=1024 * MIB)
    concurrency: int = Field(default=16, ge=1, le=256)
    cache_ttl_s: float = Field(default=60.0, ge=0, le=3600)
    window_slack_s: float = Field(default=120.0, ge=0, le=86400)
    cotenant_min_mib: int = Field(default=1024, ge=1)
    xid_overrides: dict[int, XidOverride] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ProbeSettings:
        for path, what in ((self.key_path, "SSH key"), (self.known_hosts_path, "known_hosts")):
            if not path.is_file():
                raise ValueError(f"{what} {path} is not a readable file")
        try:
            load_catalog(self.xid_overrides)
        except XidCatalogError as error:
            raise ValueError(f"xid_overrides: {error}") from error
        return self

    def catalog(self) -> XidCatalog:
        return load_catalog(self.xid_overrides)


@dataclass(frozen=True)
class ProbeRequest:
    """Probe `node` for the job that ran there from `start` to `end` (None: whole log)."""

    node: str
    start: datetime | None = None
    end: datetime | None = None


@dataclass(frozen=True)
class RawProbe:
    """One fetch from one node: the document text, or why there is none (in words, and as
    one of a fixed set of reasons for the metrics)."""

    node: str
    fetched_at: datetime
    text: str | None
    error: str | None = None
    failure: ProbeFailure | None = None


Fetch = Callable[[str], RawProbe]


def run_probe_program(settings: ProbeSettings, node: str) -> RemoteResult:
    """The probe's one command on `node` over the SSH seam, as `settings` say (user, port, key,
    pinned host keys, timeouts, output cap); the seam's errors reach the caller, who judges them
    (the prober as a failed fetch, `doctor` item by item)."""
    return run_remote(
        SshTarget(host=node, port=settings.port, user=settings.user),
        PROBE_COMMAND,
        credentials=SshCredentials(settings.key_path, settings.known_hosts_path),
        connect_timeout=settings.connect_timeout_s,
        command_timeout=settings.command_timeout_s,
        max_output_bytes=settings.max_output_bytes,
    )


class NodeProber:
    """Fetches probe documents (cached, deduplicated, bounded) and judges them per request."""

    def __init__(
        self,
        settings: ProbeSettings,
        *,
        fetch: Fetch | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """Over SSH unless `fetch` is given; the SSH key is checked here (`UnsafeKey`)."""
        if fetch is None:
            check_private_key(settings.key_path)  # at start, not at the first failed job
        self._settings = settings
        self._catalog = settings.catalog()
        self._clock = clock
        self._fetch = fetch or self._fetch_over_ssh
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, RawProbe]] = {}
        self._in_flight: dict[str, Future[RawProbe]] = {}
        self.fetch_count = 0

    @property
    def catalog(self) -> XidCatalog:
        """The XID catalog (with the operator's overrides) this prober judges by."""
        return self._catalog

    def probe(
        self, node: str, *, start: datetime | None = None, end: datetime | None = None
    ) -> NodeProbe:
        """One node, one job window."""
        return self.probe_many([ProbeRequest(node, start, end)])[0]

    def probe_many(
        self, requests: Sequence[ProbeRequest], *, fresh: bool = False
    ) -> list[NodeProbe]:
        """Each request judged; each distinct node fetched at most once (or not, if cached).
        `fresh` fetches past the cache: a sweep's check must be of now, or a node would be
        checked again each cycle on the same old document."""
        nodes = list(dict.fromkeys(request.node for request in requests))
        for node in nodes:
            if not NODE_NAME.fullmatch(node):
                raise ValueError(f"not a node name: {node[:80]!a}")
        raws = self._raw_for(nodes, fresh=fresh)
        return [self._judge(raws[request.node], request) for request in requests]

    def _raw_for(self, nodes: list[str], *, fresh: bool) -> dict[str, RawProbe]:
        results: dict[str, RawProbe] = {}
        futures: dict[str, Future[RawProbe]] = {}
        to_fetch: list[tuple[str, Future[RawProbe]]] = []
        now = time.monotonic()
        with self._lock:
            for node in nodes:
                cached = None if fresh else self._cache.get(node)
                if cached is not None and now - cached[0] <= self._settings.cache_ttl_s:
                    results[node] = cached[1]
                elif node in self._in_flight:
                    futures[node] = self._in_flight[node]
                else:
                    future: Future[RawProbe] = Future()
                    self._in_flight[node] = future
                    futures[node] = future
                    to_fetch.append((node, future))
        if to_fetch:
            workers = min(self._settings.concurrency, len(to_fetch))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="probe") as pool:
                for node, future in to_fetch:
                    pool.submit(self._fetch_into, node, future)
        for node, future in futures.items():
            results[node] = future.result()
        return results

    def _fetch_into(self, node: str, future: Future[RawProbe]) -> None:
        started = time.monotonic()
        try:
            raw = self._fetch(node)
        except Exception as error:  # a fetch bug must not leave other callers waiting
            log.exception("probe of %s failed unexpectedly", node)
            raw = RawProbe(
                node, self._clock(), None, f"probe failed: {error}", ProbeFailure.INTERNAL
            )
        probe_fetched(time.monotonic() - started, raw.failure)
        with self._lock:
            self.fetch_count += 1
            self._cache[node] = (time.monotonic(), raw)
            self._in_flight.pop(node, None)
        future.set_result(raw)

    def _fetch_over_ssh(self, node: str) -> RawProbe:
        settings = self._settings
        try:
            result = run_probe_program(settings, node)
        except (HostKeyMismatch, UnknownHostKey) as error:
            log.warning("refused %s: %s", node, error)
            return RawProbe(node, self._clock(), None, f"refused: {error}", ProbeFailure.HOST_KEY)
        except SshError as error:
            return RawProbe(node, self._clock(), None, str(error), ProbeFailure.SSH)
        if result.exit_status != 0:
            detail = result.stderr.strip().splitlines()[-1:] or ["no message"]
            return RawProbe(
                node,
                self._clock(),
                None,
                f"probe program exited {result.exit_status}: {detail[0][:200]}",
                ProbeFailure.PROBE_EXIT,
            )
        return RawProbe(node, self._clock(), result.stdout)

    def _judge(self, raw: RawProbe, request: ProbeRequest) -> NodeProbe:
        if raw.text is None:
            return unreachable(request.node, raw.fetched_at, raw.error or "no output")
        window = None
        if request.start is not None:
            window = TimeWindow(
                start=request.start,
                end=request.end or raw.fetched_at,
                slack=timedelta(seconds=self._settings.window_slack_s),
            )
        return interpret_probe(
            request.node,
            raw.text,
            probed_at=raw.fetched_at,
            catalog=self._catalog,
            window=window,
            cotenant_min_bytes=self._settings.cotenant_min_mib * MIB,
        )
