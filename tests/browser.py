"""The web page as people meet it: the real `slurm-medic web` process on a real record, seen
through Debian's chromium driven by Playwright.

The browser is the system's (/usr/bin/chromium, which deploy/install-system-packages installs);
Playwright never downloads one here, and a machine without it fails the tests that need it
rather than skipping them. The server runs as a subprocess, as an operator starts it, trusting
only loopback as its "reverse proxy": a page opened with the user header and the proxy's
secret (Playwright's `extra_http_headers`) is that user logged in through the proxy.

`seed_record` writes, through the repository functions the daemon itself uses, a small
cluster's history: alice's run waiting for her approval after a true OOM at step 0, her
earlier run fixed by policy and verified, bob's run on a node drained for XID 79, and the
fleet's last checks. The browser tests and `tests/screenshots.py` both show it.
"""

from __future__ import annotations

import http.client
import os
import pwd
import re
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

from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
from sqlalchemy.orm import Session

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.evidence.records import (
    Evidence,
    FindingKind,
    LogFindings,
    NodeProbe,
    OomFamily,
    OomReport,
    Phase,
    ProbeVerdict,
)
from daemon.fleet.findings import Finding, NodeJudgement
from daemon.fleet.node_policy import NodeDecisionKind
from daemon.slurm.records import JobState
from daemon.store import action_rows, control, node_records
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import CheckTrigger, Lineage, LineageStatus, NodeEventKind
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings
from daemon.store.states import ProposalState
from remediators.base import Lever, NodeAction, NodeActionKind
from tests.factories import ended_job
from tests.fixes import seeded_fix

REPO = Path(__file__).resolve().parent.parent
MEDIC = REPO / ".venv" / "bin" / "slurm-medic"
CHROMIUM = Path("/usr/bin/chromium")
# A closed network: no sandbox (the tests run as root), no GPU, and nothing that phones home.
CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
USER_HEADER = "X-Forwarded-User"
SECRET_HEADER = "X-Slurm-Medic-Proxy-Secret"
SERVER_START_S = 30
PAGE_TIMEOUT_MS = 15_000
LOOPBACK = "127.0.0.1"


class ChromiumMissing(RuntimeError):
    """The system chromium the browser tests drive is not installed."""


@contextmanager
def chromium() -> Iterator[Browser]:
    """Debian's chromium under Playwright, closed on the way out."""
    if not CHROMIUM.is_file():
        raise ChromiumMissing(
            f"{CHROMIUM} is missing: deploy/install-system-packages installs Debian's chromium"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=list(CHROMIUM_FLAGS)
        )
        try:
            yield browser
        finally:
            browser.close()


def page_as(browser: Browser, user: str | None, secret: str) -> tuple[BrowserContext, Page]:
    """A fresh browser context (its own cookies) logged in as `user` through the proxy header,
    or with no identity at all when `user` is None."""
    headers = {} if user is None else {USER_HEADER: user, SECRET_HEADER: secret}
    context = browser.new_context(extra_http_headers=headers)
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    return context, context.new_page()


# ---------------------------------------------------------------- the server


@dataclass(frozen=True)
class WebServer:
    """A running `slurm-medic web`: where it answers and the secret its proxy presents."""

    base_url: str
    secret: str
    log: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:])


def web_section(secret_file: Path, extra: str = "") -> str:
    """The `[web]` section of a server that believes loopback as its proxy, plus `extra`
    lines of that section."""
    return (
        "[web]\n"
        f'trusted_proxies = ["{LOOPBACK}/32"]\n'
        f'proxy_secret_file = "{secret_file}"\n'
        f'user_header = "{USER_HEADER}"\n'
        f'secret_header = "{SECRET_HEADER}"\n' + extra
    )


def write_secret(path: Path) -> str:
    """A fresh proxy secret in a file only its owner (root, in these tests) may read."""
    secret = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secret + "\n", encoding="utf-8")
    return secret


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def web_server(work_dir: Path, base_config: str, web_extra: str = "") -> Iterator[WebServer]:
    """`slurm-medic web` on a free loopback port, its config `base_config` (the record and
    any policy) plus a `[web]` section trusting loopback with a fresh secret (and the
    `web_extra` lines); stopped with SIGTERM on the way out."""
    work_dir.mkdir(parents=True, exist_ok=True)
    secret = write_secret(work_dir / "proxy-secret")
    config = work_dir / "web.toml"
    web = web_section(work_dir / "proxy-secret", web_extra)
    config.write_text(base_config + "\n" + web, encoding="utf-8")
    port = free_port()
    log = work_dir / "web.log"
    # Root itself, never root for someone: under sudo the command would refuse --config.
    env = {name: value for name, value in os.environ.items() if not name.startswith("SUDO_")}
    with log.open("ab") as output:
        server = subprocess.Popen(
            [str(MEDIC), "web", "--listen", f"{LOOPBACK}:{port}", "--config", str(config)],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    running = WebServer(f"http://{LOOPBACK}:{port}", secret, log)
    try:
        _wait_until_answering(server, port, running)
        yield running
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=15)


def _wait_until_answering(server: subprocess.Popen[bytes], port: int, running: WebServer) -> None:
    """Until the server answers HTTP at all (its /healthz needs no identity)."""
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"slurm-medic web exited {server.returncode}:\n{running.log_tail()}")
        connection = http.client.HTTPConnection(LOOPBACK, port, timeout=2)
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"slurm-medic web did not answer within {SERVER_START_S} s:\n"
                    f"{running.log_tail()}"
                ) from None
            time.sleep(0.1)
        finally:
            connection.close()


# ---------------------------------------------------------------- what people do on it


def approve_on_page(page: Page, server: WebServer, proposal_id: int, comment: str) -> str:
    """On the approvals page, the person writes `comment` on proposal `proposal_id`'s approve
    form and presses Approve; returns what the page then says (its flash), once it says the
    proposal is approved."""
    page.goto(server.url("/approvals"))
    form = page.locator(f'form[action$="/approvals/{proposal_id}/approve"]')
    form.locator("input[name=comment]").fill(comment)
    with page.expect_navigation(url=re.compile(r"/approvals\?done=")):
        form.get_by_role("button", name="Approve").click()
    said = page.locator(".flash").inner_text()
    if not said.startswith(f"proposal {proposal_id} approved by "):
        raise AssertionError(f"proposal {proposal_id}: the page said {said!r}")
    return said


# ---------------------------------------------------------------- a seeded record

GIB = 2**30
DAEMON = repo.Actor.daemon()
SICK_NODE = "gpu-03"
DRAIN_REASON = "medic: XID 79 (fallen off the bus) in job 5101"


@dataclass(frozen=True)
class SeededRecord:
    """The ids a page shows of the seeded record."""

    waiting_lineage: int  # alice's, true OOM at step 0, micro-batch halving waits for her
    waiting_proposal: int
    waiting_job: int
    verified_lineage: int  # alice's, fragmentation fixed by policy, verified
    bob_lineage: int  # bob's, XID 79 on gpu-03: drained and excluded
    bob_job: int


def make_record(database: Path) -> str:
    """A fresh SQLite record at the code's schema; its URL."""
    url = f"sqlite+pysqlite:///{database}"
    engine = make_engine(StoreSettings(url=url))
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return url


def seed_record(url: str, now: datetime | None = None) -> SeededRecord:
    """Write the seeded history into the record at `url` (at the code's schema)."""
    now = (now or datetime.now(UTC)).replace(microsecond=0)
    engine = make_engine(StoreSettings(url=url))
    try:
        with make_session_factory(engine)() as session:
            verified = _verified_fragmentation(session, now - timedelta(hours=20))
            bob_lineage, bob_job = _drained_hardware(session, now - timedelta(hours=6))
            waiting_lineage, waiting_job, waiting = _waiting_true_oom(
                session, now - timedelta(minutes=40)
            )
            _fleet_checks(session, now - timedelta(minutes=10))
            control.set_cursor(session, name="sacct", polled_until=now - timedelta(seconds=20))
            session.commit()
    finally:
        engine.dispose()
    return SeededRecord(waiting_lineage, waiting, waiting_job, verified, bob_lineage, bob_job)


def _uid(user: str) -> int:
    """The user's uid on this machine: the pages decide by the OS's accounts, as the CLI."""
    return pwd.getpwnam(user).pw_uid


def _waiting_true_oom(session: Session, when: datetime) -> tuple[int, int, int]:
    """Alice's llama run died at step 0 with too little room for the request: the
    micro-batch halving (global batch kept) waits for her."""
    job_id = 4101
    name = "llama-7b pretrain"
    lineage = repo.create_lineage(session, name=name, owner="alice", template="llama-7b")
    job = ended_job(
        job_id, uid=_uid("alice"), name=name, end=when, nodes=("gpu-01", "gpu-02"), user="alice"
    )
    repo.record_job(session, job=job, lineage_id=lineage.id, attempt=1)
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message=(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a"
            " total capacity of 79.11 GiB of which 448.00 MiB is free."
        ),
        requested_bytes=3 * GIB,
        total_bytes=int(79.11 * GIB),
        free_bytes=448 * 2**20,
        allocated_bytes=int(75.20 * GIB),
        reserved_bytes=int(76.35 * GIB),
        reserved_unallocated_bytes=int(1.15 * GIB),
        gpu_index=0,
    )
    reason = (
        "free 0.44 GiB + stranded 1.15 GiB = 1.59 GiB < the 3.00 GiB request at step 0:"
        " the activations do not fit"
    )
    incident = repo.record_incident(
        session,
        slurm_job_id=job_id,
        evidence=Evidence(
            log=LogFindings(rank=5, node="gpu-02", step=0, phase=Phase.FORWARD, oom=oom),
            job=job,
            probe=NodeProbe(
                node="gpu-02", probed_at=when, verdict=ProbeVerdict.HEALTHY, reasons=("no XID",)
            ),
        ),
        diagnosis=Diagnosis(
            kind=FailureKind.TRUE_OOM,
            confidence=Confidence.HIGH,
            reasons=(reason,),
            onset=Onset.STEP0,
            rank=5,
            node="gpu-02",
            step=0,
            phase=Phase.FORWARD,
            oom=oom,
        ),
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(
            changes=(("micro_batch", 8, 4), ("grad_accum", 4, 8)),
            expected_effect="activations halve; the peak drops by about 18 GiB",
            failing_step=0,
        ),
        rationale="micro-batch 8 -> 4, grad-accum 4 -> 8: the global batch is kept",
        cost=1.0,
        changes_science=False,
        actor=DAEMON,
    )
    repo.record_template_revision(
        session,
        lineage_id=lineage.id,
        knobs={"micro_batch": 8, "grad_accum": 4},
        rendered_script="#!/bin/bash\nexport MICRO_BATCH=8\nexport GRAD_ACCUM=4\n",
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="awaiting_approval",
        subject_type="proposal",
        subject_id=proposal.id,
        details={"reasons": ["lever batch is not in policy.auto_approve: a person decides"]},
    )
    return lineage.id, job_id, proposal.id


def _verified_fragmentation(session: Session, when: datetime) -> int:
    """Alice's earlier run: fragmentation, expandable segments by policy, verified."""
    name = "gpt-neox finetune"
    lineage = repo.create_lineage(session, name=name, owner="alice", template="neox")
    first = ended_job(3101, uid=_uid("alice"), name=name, end=when, nodes=("gpu-01",), user="alice")
    repo.record_job(session, job=first, lineage_id=lineage.id, attempt=1)
    oom = OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB.",
        requested_bytes=int(1.5 * GIB),
        total_bytes=int(79.11 * GIB),
        free_bytes=int(0.9 * GIB),
        allocated_bytes=int(68.0 * GIB),
        reserved_bytes=int(77.6 * GIB),
        reserved_unallocated_bytes=int(9.6 * GIB),
    )
    incident = repo.record_incident(
        session,
        slurm_job_id=3101,
        evidence=Evidence(
            log=LogFindings(rank=0, node="gpu-01", step=1200, phase=Phase.BACKWARD, oom=oom),
            job=first,
        ),
        diagnosis=Diagnosis(
            kind=FailureKind.FRAGMENTATION,
            confidence=Confidence.HIGH,
            reasons=("stranded 9.60 GiB >= the 1.50 GiB request: the allocator fix serves it",),
            onset=Onset.MID_RUN,
            rank=0,
            node="gpu-01",
            step=1200,
            phase=Phase.BACKWARD,
            oom=oom,
        ),
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(
            "allocator_expandable_segments",
            (("alloc_conf", "", "expandable_segments:True"),),
            lever=Lever.ALLOCATOR,
            kind=FailureKind.FRAGMENTATION,
            failing_step=1200,
        ),
        rationale="expandable segments: the stranded 9.60 GiB serves the request",
        cost=0.0,
        changes_science=False,
        actor=DAEMON,
    )
    _relaunched_and_verified(session, proposal.id, lineage.id, relaunch=3102, when=when)
    return lineage.id


def _drained_hardware(session: Session, when: datetime) -> tuple[int, int]:
    """Bob's run on gpu-03, whose kernel log shows XID 79: drained, relaunched without it."""
    name = "vit-huge sweep"
    lineage = repo.create_lineage(session, name=name, owner="bob", template="vit")
    nodes = ("gpu-03", "gpu-04")
    first = ended_job(5101, user="bob", uid=_uid("bob"), name=name, end=when, nodes=nodes)
    repo.record_job(session, job=first, lineage_id=lineage.id, attempt=1)
    incident = repo.record_incident(
        session,
        slurm_job_id=5101,
        evidence=Evidence(
            log=LogFindings(rank=2, node=SICK_NODE, step=310, phase=Phase.FORWARD),
            job=first,
            probe=NodeProbe(
                node=SICK_NODE,
                probed_at=when,
                verdict=ProbeVerdict.FAULTY,
                reasons=("XID 79 (GPU has fallen off the bus) in the job's window",),
            ),
        ),
        diagnosis=Diagnosis(
            kind=FailureKind.HARDWARE,
            confidence=Confidence.HIGH,
            reasons=("XID 79 on gpu-03 during the job: the GPU fell off the bus",),
            onset=Onset.MID_RUN,
            rank=2,
            node=SICK_NODE,
            step=310,
            phase=Phase.FORWARD,
        ),
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(
            "drain_and_exclude",
            (("exclude", (), (SICK_NODE,)),),
            lever=Lever.PLACEMENT,
            kind=FailureKind.HARDWARE,
            actions=(NodeAction(NodeActionKind.DRAIN, SICK_NODE, DRAIN_REASON),),
            failing_step=310,
        ),
        rationale="drain gpu-03 (XID 79) and relaunch without it",
        cost=0.0,
        changes_science=False,
        actor=DAEMON,
    )
    control.record_node_event(
        session,
        node=SICK_NODE,
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason=DRAIN_REASON,
        occurred_at=when + timedelta(minutes=1),
        incident_id=incident.id,
        finding=FindingKind.FALLEN_OFF_BUS.value,
    )
    _relaunched_and_verified(session, proposal.id, lineage.id, relaunch=5102, when=when)
    return lineage.id, 5101


def _relaunched_and_verified(
    session: Session, proposal_id: int, lineage_id: int, *, relaunch: int, when: datetime
) -> None:
    """Policy approves, the relaunch is submitted once, runs past the failing step, verified."""
    repo.transition_proposal(
        session,
        proposal_id=proposal_id,
        to=ProposalState.APPROVED,
        actor=DAEMON,
        reason="policy: the lever is in policy.auto_approve",
    )
    intent = action_rows.record_submit_intent(
        session,
        proposal_id=proposal_id,
        build_argv=lambda token: ["sbatch", f"--comment={token}", "job.sh"],
        actor=DAEMON,
    )
    action_rows.record_submitted(session, intent=intent, slurm_job_id=relaunch, actor=DAEMON)
    lineage = repo.get_row(session, Lineage, lineage_id)
    repo.record_job(
        session,
        job=ended_job(
            relaunch,
            user=lineage.owner,
            uid=_uid(lineage.owner),
            name=lineage.name,
            state=JobState.COMPLETED,
            end=when + timedelta(hours=2),
            nodes=("gpu-01", "gpu-02"),
        ),
        lineage_id=lineage_id,
        attempt=2,
    )
    for state in (ProposalState.VERIFYING, ProposalState.VERIFIED):
        repo.transition_proposal(session, proposal_id=proposal_id, to=state, actor=DAEMON)
    repo.set_lineage_status(
        session,
        lineage_id=lineage_id,
        status=LineageStatus.VERIFIED,
        actor=DAEMON,
        reason="passed the failing step and wrote a checkpoint",
    )


def _fleet_checks(session: Session, when: datetime) -> None:
    """The fleet's last sweep: two healthy nodes, gpu-03 faulty, gpu-04 degraded."""
    xid = Finding(
        FindingKind.FALLEN_OFF_BUS, ProbeVerdict.FAULTY, "GPU 4: XID 79 (fallen off the bus)", 4
    )
    ecc = Finding(
        FindingKind.ECC_CORRECTABLE,
        ProbeVerdict.DEGRADED,
        "GPU 2 (00000000:47:00.0): 177 correctable",
        2,
    )
    checks: Mapping[str, tuple[Finding, ...]] = {
        "gpu-01": (),
        "gpu-02": (),
        SICK_NODE: (xid,),
        "gpu-04": (ecc,),
    }
    for node, findings in checks.items():
        judgement = NodeJudgement(
            node=node,
            probed_at=when,
            health=findings[0].health if findings else ProbeVerdict.HEALTHY,
            findings=findings,
            deciding=findings[0].text if findings else "8 GPUs of 8: healthy",
            gpus_seen=8,
            gpus_expected=8,
            running_jobs=(),
        )
        sick = node == SICK_NODE
        node_records.record_check(
            session,
            judgement,
            trigger=CheckTrigger.SCHEDULE,
            decision=NodeDecisionKind.ALREADY_DRAINED if sick else NodeDecisionKind.RECORD,
            decision_reason="drained for job 5101's XID 79"
            if sick
            else "nothing policy drains for",
            actor_name="slurm-medic",
        )
