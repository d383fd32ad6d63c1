"""A seeded SQLite record and a web app on it, for the web page's tests.

Requests come over TCP from a trusted proxy that names the user (`as_user`); the proxy's
secret is in a 0600 file, as the server reads it.
"""

from __future__ import annotations

import http.client
import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.testclient import TestClient

from daemon.commands.context import CommandContext
from daemon.config import load_settings
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import AuditEvent, Proposal, WebRequest
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from daemon.web.app import create_app
from daemon.web.identity import read_proxy_secret
from tests.factories import ended_job
from tests.fixes import seeded_fix

MEDIC = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "slurm-medic"
LOOPBACK = "127.0.0.1"
START_S = 30
NOW = datetime.now(UTC).replace(microsecond=0)
DAEMON = repo.Actor.daemon()
HOSTILE_NAME = '<script>alert("name")</script>'
HOSTILE_RATIONALE = "<img src=x onerror=alert(1)> keeps the global batch"
PROXY = ("10.9.8.7", 40000)
STRANGER = ("10.1.2.3", 40000)
OWNER = "alice"  # uid 1001, as tests/test_cli_people.py
OTHER = "nobody"  # neither the owner nor an admin
ADMIN = "daemon"  # in policy.admin_groups through its group `daemon`


class Answer(Protocol):
    """A test client's response: httpx's, or httpx2's where Starlette finds that installed."""

    status_code: int

    @property
    def text(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def json(self) -> Any: ...


@dataclass(frozen=True)
class WebRecord:
    engine: Engine
    config: Path
    secret: str
    alices_proposal: int  # waiting; the job of alice named HOSTILE_NAME
    daemons_proposal: int  # waiting; the job of the user `daemon`

    def app(self) -> Starlette:
        settings = load_settings(self.config)
        assert settings.web.proxy_secret_file is not None
        secret = read_proxy_secret(settings.web.proxy_secret_file)
        return create_app(CommandContext(settings), proxy_secret=secret)

    def client(self, *, client: tuple[str, int] = PROXY) -> TestClient:
        return TestClient(self.app(), client=client, follow_redirects=False)

    def headers(self, user: str) -> dict[str, str]:
        return {"X-Forwarded-User": user, "X-Slurm-Medic-Proxy-Secret": self.secret}

    def proposal(self, proposal_id: int) -> Proposal:
        with make_session_factory(self.engine)() as session:
            proposal = session.get(Proposal, proposal_id)
            assert proposal is not None
            return proposal

    def audit(self, verb: str) -> list[AuditEvent]:
        with make_session_factory(self.engine)() as session:
            return list(session.scalars(select(AuditEvent).where(AuditEvent.verb == verb)))

    def web_requests(self) -> list[WebRequest]:
        with make_session_factory(self.engine)() as session:
            return list(session.scalars(select(WebRequest)))


def _waiting_proposal(session: Session, job_id: int, user: str, name: str) -> int:
    uid = pwd.getpwnam(user).pw_uid
    lineage = repo.create_lineage(session, name=name, owner=user, template="llama-7b")
    job = ended_job(job_id, user=user, uid=uid, name=name, end=NOW - timedelta(hours=1))
    repo.record_job(session, job=job, lineage_id=lineage.id, attempt=1)
    incident = repo.record_incident(
        session,
        slurm_job_id=job_id,
        evidence=Evidence(job=job),
        diagnosis=Diagnosis(
            kind=FailureKind.TRUE_OOM, confidence=Confidence.HIGH, reasons=("too big",)
        ),
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(),
        rationale=HOSTILE_RATIONALE,
        cost=1.0,
        changes_science=False,
        actor=DAEMON,
    )
    return proposal.id


def write_secret(path: Path) -> str:
    secret = secrets.token_hex(24)
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return secret


@contextmanager
def web_record_at(
    tmp_path: Path, *, trusted_proxies: str = "10.9.8.0/24", web_extra: str = ""
) -> Iterator[WebRecord]:
    """A record with a waiting proposal for alice and one for `daemon`, and a config that
    trusts `trusted_proxies` (`PROXY`'s network unless told) with a fresh secret, plus the
    `web_extra` lines of its `[web]` section; a test module's fixture wraps it."""
    url = sqlite_url(tmp_path / "record.db")
    engine = make_engine(StoreSettings(url=url))
    upgrade(engine)
    with make_session_factory(engine)() as session:
        alices = _waiting_proposal(session, 1001, OWNER, HOSTILE_NAME)
        daemons = _waiting_proposal(session, 3001, ADMIN, "daemon's run")
        session.commit()
    secret = write_secret(tmp_path / "proxy.secret")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[store]\nurl = "{url}"\n\n[policy]\nadmin_groups = ["{ADMIN}"]\n\n'
        f'[web]\ntrusted_proxies = ["{trusted_proxies}"]\n'
        f'proxy_secret_file = "{tmp_path}/proxy.secret"\n{web_extra}'
    )
    yield WebRecord(engine, config, secret, alices, daemons)
    engine.dispose()


# ---------------------------------------------------------------- the real server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class WebProcess:
    """A running `slurm-medic web`, as an operator starts it: on a unix socket (`path`) or
    on loopback (`port`), its log (JSON lines) in a file."""

    process: subprocess.Popen[bytes]
    log: Path
    path: Path | None = None
    port: int | None = None

    def connect(self, *, source: str | None = None, timeout_s: float = 10.0) -> socket.socket:
        """A new connection: to the socket, or to the port from `source` (a loopback
        address, 127.0.0.1 unless told)."""
        if self.path is not None:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.settimeout(timeout_s)
            connection.connect(str(self.path))
            return connection
        assert self.port is not None
        return socket.create_connection(
            (LOOPBACK, self.port), timeout=timeout_s, source_address=(source or LOOPBACK, 0)
        )

    def entries(self) -> list[dict[str, Any]]:
        """The log's JSON lines (anything else it holds, as {"msg": line})."""
        found: list[dict[str, Any]] = []
        for line in self.log.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"msg": line}
            found.append(entry if isinstance(entry, dict) else {"msg": line})
        return found

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def request(
    connection: socket.socket, path: str, headers: Mapping[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """GET `path` on an open connection (kept open): status, headers (lower-case), body."""
    lines = [f"GET {path} HTTP/1.1", "Host: slurm-medic"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    answer = http.client.HTTPResponse(connection)
    answer.begin()
    body = answer.read()
    return answer.status, {k.lower(): v for k, v in answer.getheaders()}, body


@contextmanager
def web_process(
    config: Path,
    work: Path,
    *,
    path: Path | None = None,
    port: int | None = None,
    nofile: tuple[int, int] | None = None,
) -> Iterator[WebProcess]:
    """`slurm-medic web --config config` on the unix socket `path` or on loopback `port`,
    started as root itself (never root for someone: under sudo the command would refuse
    --config), under the descriptor limits `nofile` (soft, hard) if given, and stopped with
    SIGTERM on the way out."""
    where = ["--socket", str(path)] if path is not None else ["--listen", f"{LOOPBACK}:{port}"]
    limited = [] if nofile is None else ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}"]
    log = work / "web.log"
    env = {name: value for name, value in os.environ.items() if not name.startswith("SUDO_")}
    with log.open("ab") as output:
        process = subprocess.Popen(
            [*limited, str(MEDIC), "web", "--config", str(config), *where],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    running = WebProcess(process, log, path, port)
    try:
        _wait_until_answering(running)
        yield running
    finally:
        stop(running)


def stop(running: WebProcess) -> None:
    """SIGTERM, as systemd stops it; SIGKILL to its group if it does not end."""
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
    try:
        running.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(running.process.pid, signal.SIGKILL)
        running.process.wait(timeout=15)


def _wait_until_answering(running: WebProcess) -> None:
    deadline = time.monotonic() + START_S
    while True:
        if running.process.poll() is not None:
            raise RuntimeError(f"slurm-medic web exited:\n{running.log_tail()}")
        try:
            with running.connect(timeout_s=2) as connection:
                answered = request(connection, "/healthz", {"Connection": "close"})[0] == 200
                # Read to the server's close, so that this probe holds no slot once it returns.
                while connection.recv(4096):
                    pass
                if answered:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"slurm-medic web did not answer:\n{running.log_tail()}")
        time.sleep(0.1)


def request_as(
    user: str,
    target: str,
    *,
    path: Path | None = None,
    port: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """GET `target` from a process of `user` (the kernel names them to the server), on the
    unix socket `path` or on loopback `port`: the status and the body. The system's Python,
    standard library only, so that the user needs nothing of this checkout."""
    script = (
        "import socket, sys, http.client\n"
        "where, target, extra = sys.argv[1], sys.argv[2], sys.argv[3:]\n"
        "if where.isdigit():\n"
        "    s = socket.socket(); s.settimeout(20); s.connect(('127.0.0.1', int(where)))\n"
        "else:\n"
        "    s = socket.socket(socket.AF_UNIX); s.settimeout(20); s.connect(where)\n"
        "head = ['GET ' + target + ' HTTP/1.1', 'Host: x', 'Connection: close', *extra]\n"
        "try:\n"
        "    s.sendall(('\\r\\n'.join(head) + '\\r\\n\\r\\n').encode())\n"
        "except OSError:\n"
        "    pass  # refused at once: its answer is still there to read\n"
        "r = http.client.HTTPResponse(s); r.begin()\n"
        "sys.stdout.write(str(r.status) + '\\n' + r.read().decode('utf-8', 'replace'))\n"
    )
    where = str(path) if path is not None else str(port)
    extra = [f"{name}: {value}" for name, value in (headers or {}).items()]
    entry = pwd.getpwnam(user)
    done = subprocess.run(
        ["/usr/bin/python3", "-c", script, where, target, *extra],
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{user}'s request failed: {done.stderr.decode(errors='replace')}")
    status, _, body = done.stdout.decode("utf-8", "replace").partition("\n")
    return int(status), body


@contextmanager
def held_as(user: str, path: Path, count: int) -> Iterator[None]:
    """`count` idle connections to the unix socket `path` held by a process of `user` (the
    system's Python) until the block ends."""
    script = (
        "import socket, sys\n"
        "held = []\n"
        "for _ in range(int(sys.argv[2])):\n"
        "    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); held.append(s)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    entry = pwd.getpwnam(user)
    holder = subprocess.Popen(
        ["/usr/bin/python3", "-c", script, str(path), str(count)],
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"held\n", f"{user} could not hold {count}"
        yield
    finally:
        holder.communicate(timeout=30)  # closes its stdin: it ends, and its connections
