"""A seeded SQLite record and a web app on it, for the web page's tests.

Requests come over TCP from a trusted proxy that names the user (`as_user`); the proxy's
secret is in a 0600 file, as the server reads it.
"""

from __future__ import annotations

import pwd
import secrets
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
def web_record_at(tmp_path: Path) -> Iterator[WebRecord]:
    """A record with a waiting proposal for alice and one for `daemon`, and a config that
    trusts `PROXY` with a fresh secret; a test module's fixture wraps it."""
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
        f'[web]\ntrusted_proxies = ["10.9.8.0/24"]\nproxy_secret_file = "{tmp_path}/proxy.secret"\n'
    )
    yield WebRecord(engine, config, secret, alices, daemons)
    engine.dispose()
