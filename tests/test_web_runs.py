"""The runs pages and their JSON on a real record (SQLite and PostgreSQL), through the real app
(identity middleware included) with Starlette's TestClient: filters and pages, who sees which
run, a run's story with its OOM bar, hostile text escaped, and `/api/history` and
`/api/show/{ref}` equal to the CLI's `--json` on the same record. The OOM bar's arithmetic is
checked on the real OOM messages in tests/data.

`Site` and its seed are shared by tests/test_web_nodes.py and tests/test_web_shadow.py."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from daemon.cli import main
from daemon.commands.context import CommandContext
from daemon.config import load_settings
from daemon.diagnosis import Confidence, Diagnosis, FailureKind, Onset
from daemon.evidence.oom import parse_oom
from daemon.evidence.records import Evidence, LogFindings, OomReport, Phase
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import action_rows, control
from daemon.store import repository as repo
from daemon.store.engine import make_session_factory
from daemon.store.models import CheckTrigger, Incident, LineageStatus, NodeCheck, NodeEventKind
from daemon.store.schema import upgrade
from daemon.store.states import ProposalState
from daemon.web.app import create_app
from daemon.web.identity import read_proxy_secret
from daemon.web.oom_bar import DERIVED, GIB, NOT_PRINTED, OomFigures, Part, gib_text, oom_bar
from tests.factories import ended_job
from tests.fixes import seeded_fix
from tests.web_support import Answer

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

NOW = datetime.now(UTC).replace(microsecond=0)
DATA = Path(__file__).parent / "data"
PROXY = ("10.9.8.7", 40000)
DAEMON = repo.Actor.daemon()
ADMIN = "daemon"  # in policy.admin_groups through its group `daemon`
HOSTILE_NAME = 'llama <script>alert("job")</script>'
HOSTILE_REASON = "<img src=x onerror=alert(1)> reserved 18.43 GiB, the activations do not fit"
SCRIPT_BEFORE = "#!/bin/bash\n#SBATCH --nodes=2\n--micro-batch-size 8 \\\n--grad-accum 4\n"
SCRIPT_AFTER = "#!/bin/bash\n#SBATCH --nodes=2\n--micro-batch-size 4 \\\n--grad-accum 8\n"
WOULD_APPROVE_REASON = "allocator_expandable_segments is in policy.auto_approve"
DRY_RUN_HOLD = "dry-run mode: would drain_now (remap_failure: drained now)"


def oom_sample(name: str) -> OomReport:
    report = parse_oom((DATA / "oom" / name).read_text())
    assert report is not None, name
    return report


@dataclass(frozen=True)
class Seeded:
    alice_lineage: int  # true OOM (torch 2.4's message), fixed, relaunched, verified
    bob_lineage: int  # fragmentation (torch 1.0's message), policy would approve under dry run
    bob_proposal: int
    alice_incident: int


@dataclass(frozen=True)
class Site:
    engine: Engine
    config: Path
    secret: str
    seeded: Seeded

    def client(self) -> TestClient:
        settings = load_settings(self.config)
        assert settings.web.proxy_secret_file is not None
        app = create_app(
            CommandContext(settings),
            proxy_secret=read_proxy_secret(settings.web.proxy_secret_file),
        )
        return TestClient(app, client=PROXY, follow_redirects=False)

    def get(self, who: str, path: str, /, **params: str) -> Answer:
        """GET `path` as the proxy's user `who`, with `params` as its query string."""
        return self.client().get(path, params=params or None, headers=self.headers(who))

    def headers(self, user: str) -> dict[str, str]:
        return {"X-Forwarded-User": user, "X-Slurm-Medic-Proxy-Secret": self.secret}

    def cli_json(self, *args: str) -> Any:
        """The CLI's `--json` document on the same record (as root, with this config)."""
        env = {"COLUMNS": "250", "SUDO_UID": ""}
        with mock.patch("daemon.config.DEFAULT_CONFIG_PATH", self.config):
            result = CliRunner().invoke(main, [*args, "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    def session(self) -> Session:
        return make_session_factory(self.engine)()


def _job(
    job_id: int, user: str, name: str, state: JobState, end: datetime, *nodes: str
) -> SlurmJob:
    uid = {"alice": 1001, "bob": 1002}[user]
    return ended_job(job_id, user=user, uid=uid, name=name, state=state, end=end, nodes=nodes)


def _incident(
    session: Session,
    job: SlurmJob,
    kind: FailureKind,
    oom: OomReport | None,
    reasons: Sequence[str],
    node: str,
) -> Incident:
    evidence = Evidence(
        log=LogFindings(rank=0, node=node, step=0, phase=Phase.FORWARD, oom=oom), job=job
    )
    diagnosis = Diagnosis(
        kind=kind,
        confidence=Confidence.HIGH,
        reasons=tuple(reasons),
        onset=Onset.STEP0,
        rank=0,
        node=node,
        step=0,
        phase=Phase.FORWARD,
        oom=oom,
    )
    return repo.record_incident(
        session, slurm_job_id=job.job_id, evidence=evidence, diagnosis=diagnosis
    )


def seed(session: Session) -> Seeded:
    """alice's run: died of a true OOM 3 h ago, fixed, relaunched, verified; an old failure of
    hers 10 days ago; bob's run: fragmentation 1 h ago whose relaunch policy would have
    approved under dry run, and the same job name dying again 30 min ago (an XLA message with
    no card figures); medic's drain of gpu-02 and a dry run's held drain of gpu-04."""
    lineage = repo.create_lineage(session, name=HOSTILE_NAME, owner="alice", template="llama")
    first = _job(1001, "alice", HOSTILE_NAME, JobState.FAILED, NOW - timedelta(hours=3), "gpu-02")
    repo.record_job(session, job=first, lineage_id=lineage.id, attempt=1)
    incident = _incident(
        session,
        first,
        FailureKind.TRUE_OOM,
        oom_sample("torch24_torch_oome.txt"),
        (HOSTILE_REASON,),
        "gpu-02",
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(changes=(("micro_batch", 8, 4), ("grad_accum", 4, 8)), failing_step=0),
        rationale="micro-batch 8 -> 4, grad-accum 4 -> 8: the global batch is kept",
        cost=1.0,
        changes_science=False,
        actor=DAEMON,
    )
    parent = repo.record_template_revision(
        session, lineage_id=lineage.id, knobs={"micro_batch": 8}, rendered_script=SCRIPT_BEFORE
    )
    relaunched = repo.record_template_revision(
        session,
        lineage_id=lineage.id,
        knobs={"micro_batch": 4},
        rendered_script=SCRIPT_AFTER,
        parent_id=parent.id,
        proposal_id=proposal.id,
    )
    repo.record_relaunch_revision(
        session, proposal=proposal, revision_id=relaunched.id, resumed_step=0
    )
    alice = repo.Actor.user("alice", 1001)
    repo.transition_proposal(
        session,
        proposal_id=proposal.id,
        to=ProposalState.APPROVED,
        actor=alice,
        reason="fine, the global batch is kept",
    )
    repo.append_audit(
        session,
        actor=alice,
        verb="decision_authority",
        subject_type="proposal",
        subject_id=proposal.id,
        details={"decision": "approved", "grounds": "job owner"},
    )
    intent = action_rows.record_submit_intent(
        session,
        proposal_id=proposal.id,
        build_argv=lambda token: ["sbatch", f"--comment={token}", "job.sh"],
        actor=DAEMON,
    )
    action_rows.record_submitted(session, intent=intent, slurm_job_id=1002, actor=DAEMON)
    second = _job(1002, "alice", HOSTILE_NAME, JobState.COMPLETED, NOW - timedelta(hours=1))
    repo.record_job(session, job=second, lineage_id=lineage.id, attempt=2)
    for state in (ProposalState.VERIFYING, ProposalState.VERIFIED):
        repo.transition_proposal(session, proposal_id=proposal.id, to=state, actor=DAEMON)
    repo.set_lineage_status(
        session,
        lineage_id=lineage.id,
        status=LineageStatus.VERIFIED,
        actor=DAEMON,
        reason="passed step 2 and wrote checkpoint-100",
    )
    control.record_node_event(
        session,
        node="gpu-02",
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason="medic: XID 79 on GPU 3",
        incident_id=incident.id,
    )
    old = _job(1500, "alice", "old run", JobState.FAILED, NOW - timedelta(days=10), "gpu-01")
    repo.record_job(session, job=old)
    _incident(session, old, FailureKind.HOST_RAM, None, ("exit 137, no traceback",), "gpu-01")

    bobs = repo.create_lineage(session, name="vit sweep", owner="bob", template="vit")
    fragmented = _job(2001, "bob", "vit sweep", JobState.FAILED, NOW - timedelta(hours=1), "gpu-04")
    repo.record_job(session, job=fragmented, lineage_id=bobs.id, attempt=1)
    bobs_incident = _incident(
        session,
        fragmented,
        FailureKind.FRAGMENTATION,
        oom_sample("torch10_cached.txt"),
        ("stranded bytes cover the request",),
        "gpu-04",
    )
    bobs_proposal = repo.propose(
        session,
        incident_id=bobs_incident.id,
        fix=seeded_fix("allocator_expandable_segments", (("alloc_conf", "", "expandable"),)),
        rationale="expandable segments",
        cost=0.0,
        changes_science=False,
        actor=DAEMON,
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="dry_run_would_approve",
        subject_type="proposal",
        subject_id=bobs_proposal.id,
        details={"reasons": [WOULD_APPROVE_REASON]},
    )
    again = _job(2002, "bob", "vit sweep", JobState.FAILED, NOW - timedelta(minutes=30), "gpu-04")
    repo.record_job(session, job=again)
    _incident(
        session, again, FailureKind.UNKNOWN, oom_sample("xla.txt"), ("XLA ran out",), "gpu-04"
    )
    session.add(
        NodeCheck(
            node="gpu-04",
            checked_at=NOW - timedelta(hours=2),
            trigger=CheckTrigger.SCHEDULE.value,
            health="faulty",
            deciding="GPU 5: row remapping failure occurred",
            kinds=",remap_failure,",
            findings=[],
            notes=[],
            gpus_seen=8,
            gpus_expected=8,
            running_jobs=[],
            decision="held",
            decision_reason=DRY_RUN_HOLD,
            actor_name="slurm-medic",
        )
    )
    session.commit()
    return Seeded(lineage.id, bobs.id, bobs_proposal.id, incident.id)


def write_config(path: Path, url: str, secret_file: Path) -> Path:
    path.write_text(
        f'[store]\nurl = "{url}"\n\n[policy]\nadmin_groups = ["{ADMIN}"]\n\n'
        f'[web]\ntrusted_proxies = ["{PROXY[0]}/32"]\nproxy_secret_file = "{secret_file}"\n'
    )
    return path


def make_site(engine: Engine, tmp_path: Path) -> Site:
    """The seeded record on `engine` (empty), its config and the proxy's secret file."""
    upgrade(engine)
    with make_session_factory(engine)() as session:
        seeded = seed(session)
    secret = secrets.token_hex(24)
    secret_file = tmp_path / "proxy.secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    url = engine.url.render_as_string(hide_password=False)
    config = write_config(tmp_path / "config.toml", url, secret_file)
    return Site(engine, config, secret, seeded)


@pytest.fixture
def site(empty_db_engine: Engine, tmp_path: Path) -> Site:
    return make_site(empty_db_engine, tmp_path)


def jobs_listed(response: Answer) -> list[int]:
    """The job ids of the runs table, top to bottom."""
    assert response.status_code == 200, response.text
    return [int(job) for job in re.findall(r'<td><a href="/jobs/([0-9]+)">', response.text)]


# ---------------------------------------------------------------- the runs list


def test_runs_are_newest_first_and_link_to_their_run(site: Site) -> None:
    page = site.get(ADMIN, "/runs")
    assert jobs_listed(page) == [2002, 2001, 1001]  # alice's 10-day-old failure is past 7d
    assert f'<a href="/runs/{site.seeded.alice_lineage}">' in page.text
    assert f'<a href="/runs/{site.seeded.bob_lineage}">' in page.text


@pytest.mark.parametrize(
    ("params", "jobs"),
    [
        ({"kind": "fragmentation"}, [2001]),
        ({"user": "alice"}, [1001]),
        ({"state": "verified"}, [1001]),
        ({"state": "active"}, [2001]),
        ({"since": "30d"}, [2002, 2001, 1001, 1500]),
        ({"since": "30d", "until": "2h"}, [1001, 1500]),
        ({"since": (NOW - timedelta(days=11)).date().isoformat(), "user": "alice"}, [1001, 1500]),
        ({"kind": "hardware"}, []),
    ],
)
def test_runs_filters(site: Site, params: dict[str, str], jobs: list[int]) -> None:
    assert jobs_listed(site.get(ADMIN, "/runs", **params)) == jobs


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"kind": "bogus"}, "kind: &#39;bogus&#39; is none of"),
        ({"state": "dead"}, "state: &#39;dead&#39; is none of"),
        ({"since": "last tuesday"}, "since: &#39;last tuesday&#39; is neither a duration"),
        ({"since": "1h", "until": "2h"}, "since: must be before until"),
        ({"limit": "0"}, "limit: &#39;0&#39; is not a number from 1 to 200"),
        ({"limit": "100000"}, "limit: &#39;100000&#39; is not a number from 1 to 200"),
        ({"older_than": "-1"}, "older_than: &#39;-1&#39; is not a number"),
    ],
)
def test_a_filter_that_cannot_be_read_is_400_saying_which(
    site: Site, params: dict[str, str], said: str
) -> None:
    page = site.get(ADMIN, "/runs", **params)
    assert page.status_code == 400
    assert said in page.text


def test_runs_come_in_bounded_pages_that_follow_each_other(site: Site) -> None:
    seen: list[int] = []
    path, params = "/runs", {"since": "30d", "limit": "1"}
    for _ in range(5):
        page = site.get(ADMIN, path, **params)
        seen += jobs_listed(page)
        assert len(jobs_listed(page)) <= 1
        older = re.search(r'<a href="([^"]+)" rel="next">', page.text)
        if older is None:
            break
        path, params = older.group(1).replace("&amp;", "&"), {}
    assert seen == [2002, 2001, 1001, 1500]


def test_a_person_sees_only_their_runs_and_others_are_not_counted(site: Site) -> None:
    assert jobs_listed(site.get("bob", "/runs")) == [2002, 2001]
    assert jobs_listed(site.get("bob", "/runs", user="alice")) == []
    assert jobs_listed(site.get("alice", "/runs", since="30d")) == [1001, 1500]
    alone = site.get("bob", "/runs", limit="2")
    assert 'rel="next"' not in alone.text  # alice's run below bob's two makes no next page
    assert "You see your own runs only" in alone.text


# ---------------------------------------------------------------- a run's story


def test_a_runs_story_has_its_diagnosis_oom_bar_decisions_diff_and_verification(
    site: Site,
) -> None:
    page = site.get("alice", f"/runs/{site.seeded.alice_lineage}")
    assert page.status_code == 200, page.text
    text = page.text
    assert "Diagnosis: true_oom" in text
    assert "&lt;img src=x onerror=alert(1)&gt; reserved 18.43 GiB" in text
    caption = re.search(r'<figcaption id="oom-[0-9]+-caption">([^<]+)</figcaption>', text)
    assert caption is not None
    assert caption.group(1) == (
        "22.78 GiB requested on a 31.47 GiB card; free 12.73 GiB + stranded 9.35 GiB"
        " = 22.08 GiB, short of the request by 0.70 GiB"
    )
    titles = re.findall(r"<title>([^<]+)</title>", text.split('class="oom-bar"')[1])
    assert titles[:5] == [
        "allocated by PyTorch: 9.08 GiB",
        "stranded (reserved but unallocated): 9.35 GiB",
        "in use outside PyTorch&#39;s reserve: 0.31 GiB",
        "free: 12.73 GiB",
        "requested: 22.78 GiB",
    ]
    assert '<th scope="row">the card&#39;s total</th><td>31.47 GiB</td>' in text
    assert "Decided by alice (job owner)." in text
    assert "fine, the global batch is kept" in text
    assert '<span class="del">---micro-batch-size 8 \\</span>' in text
    assert '<span class="add">+--micro-batch-size 4 \\</span>' in text
    assert 'Relaunched as job <a href="/jobs/1002">1002</a>' in text
    assert '<span class="badge good">verified</span>' in text
    assert "medic: XID 79 on GPU 3" in text


def test_hostile_strings_are_shown_as_text_never_markup(site: Site) -> None:
    for user, path in (("alice", f"/runs/{site.seeded.alice_lineage}"), (ADMIN, "/runs")):
        page = site.get(user, path, since="30d")
        assert "<script>" not in page.text
        assert "<img src=x" not in page.text
    story = site.get("alice", f"/runs/{site.seeded.alice_lineage}").text
    assert "llama &lt;script&gt;alert(&#34;job&#34;)&lt;/script&gt;" in story


def test_a_job_redirects_to_its_run_and_a_job_of_no_run_has_its_own_page(site: Site) -> None:
    redirect = site.get("alice", "/jobs/1002")
    assert redirect.status_code == 303
    assert redirect.headers["location"] == f"/runs/{site.seeded.alice_lineage}"
    page = site.get("bob", "/jobs/2002")
    assert page.status_code == 200
    assert "belongs to no run slurm-medic follows" in page.text
    asked = gib_text(oom_sample("xla.txt").requested_bytes or 0)
    assert f"{asked} requested on no card total printed; the message printed no free" in page.text
    assert f'<th scope="row">free on the card</th><td>{NOT_PRINTED}</td>' in page.text


@pytest.mark.parametrize(
    "path", ["/runs/{alice}", "/jobs/1001", "/jobs/1002", "/runs/{missing}", "/jobs/31337"]
)
def test_another_users_run_is_404_like_one_that_does_not_exist(site: Site, path: str) -> None:
    page = site.get("bob", path.format(alice=site.seeded.alice_lineage, missing=999_999))
    assert page.status_code == 404
    assert "is not in the record" in page.text
    assert "llama" not in page.text
    assert "alice" not in page.text


def test_an_admin_sees_anyones_run(site: Site) -> None:
    assert site.get(ADMIN, f"/runs/{site.seeded.alice_lineage}").status_code == 200
    assert site.get(ADMIN, "/runs/99999999999").status_code == 404


# ---------------------------------------------------------------- JSON, as the CLI's


def test_api_history_is_the_clis_history_json(site: Site) -> None:
    since = (NOW - timedelta(days=30)).isoformat()
    everything = site.get(ADMIN, "/api/history", since=since).json()
    assert everything == site.cli_json("history", "--since", since)
    assert [row["job"] for row in everything["incidents"]] == [2002, 2001, 1001, 1500]
    narrowed = site.get(ADMIN, "/api/history", since=since, kind="true_oom", limit="5").json()
    assert narrowed == site.cli_json("history", "--since", since, "--kind", "true_oom")
    bobs = site.get("bob", "/api/history", since=since).json()
    assert bobs == site.cli_json("history", "--since", since, "--user", "bob")
    assert site.get("bob", "/api/history", since=since, user="alice").json()["incidents"] == []
    refused = site.get(ADMIN, "/api/history", limit="10001")
    assert refused.status_code == 400
    assert refused.json() == {"error": "limit: '10001' is not a number from 1 to 10000"}


def test_api_show_is_the_clis_show_json(site: Site) -> None:
    lineage = f"L{site.seeded.alice_lineage}"
    for user, reference in (("alice", lineage), ("alice", "1002"), (ADMIN, "2002")):
        shown = site.get(user, f"/api/show/{reference}")
        assert shown.status_code == 200, shown.text
        assert shown.json() == site.cli_json("show", reference)
    assert site.get(ADMIN, "/api/show/gpu-02").json() == site.cli_json("show", "gpu-02")


def test_api_show_hides_anothers_run_and_incidents(site: Site) -> None:
    lineage = f"L{site.seeded.alice_lineage}"
    hidden = site.get("bob", f"/api/show/{lineage}")
    missing = site.get("bob", "/api/show/L999999")
    assert (hidden.status_code, missing.status_code) == (404, 404)
    assert hidden.json() == {"error": f"{lineage} is not in the record"}
    assert site.get("bob", "/api/show/1001").status_code == 404
    node = site.get("bob", "/api/show/gpu-02").json()
    assert [entry["what"] for entry in node["story"]] == ["drain"]
    admin_view = site.get(ADMIN, "/api/show/gpu-02").json()
    assert [entry["what"] for entry in admin_view["story"]] == ["incident", "drain"]
    assert site.get("bob", "/api/show/gpu;reboot").status_code == 400


# ---------------------------------------------------------------- the OOM bar


def figures_of(report: OomReport) -> OomFigures:
    return OomFigures(
        report.requested_bytes,
        report.total_bytes,
        report.free_bytes,
        report.allocated_bytes,
        report.reserved_bytes,
        report.reserved_unallocated_bytes,
    )


def _widths_follow_sizes(segments: Sequence[Any], scale: int) -> None:
    start = 0.0
    for segment in segments:
        assert segment.start == pytest.approx(start)
        assert segment.width == pytest.approx(segment.size / scale * 100)
        start += segment.width
    assert start <= 100 + 1e-9


def test_the_bar_of_a_torch_24_message_draws_every_figure_it_printed() -> None:
    report = oom_sample("torch24_torch_oome.txt")
    bar = oom_bar(figures_of(report))
    assert bar is not None
    assert [(s.part, s.gib) for s in bar.card] == [
        (Part.ALLOCATED, "9.08 GiB"),
        (Part.STRANDED, "9.35 GiB"),
        (Part.OTHER, "0.31 GiB"),  # 31.47 - 12.73 free - 18.43 reserved
        (Part.FREE, "12.73 GiB"),
    ]
    assert bar.scale == report.total_bytes
    assert sum(segment.size for segment in bar.card) == report.total_bytes
    _widths_follow_sizes(bar.card, bar.scale)
    assert bar.request is not None
    assert bar.request.width == pytest.approx(22.78 / 31.47 * 100, abs=0.01)
    assert dict(bar.figures)["reserved by PyTorch"] == "18.43 GiB"


def test_the_bar_says_which_figures_a_message_did_not_print() -> None:
    xla = oom_sample("xla.txt")  # a request and no card
    bar = oom_bar(OomFigures(requested=xla.requested_bytes))
    assert bar is not None
    assert bar.card == ()
    assert bar.request is not None
    assert bar.request.width == pytest.approx(100)
    assert [value for _, value in bar.figures][1:] == [NOT_PRINTED] * 5
    assert bar.summary == (
        f"{gib_text(xla.requested_bytes or 0)} requested on no card total printed;"
        " the message printed no free memory"
    )
    no_free = oom_bar(OomFigures(requested=GIB, total=16 * GIB, allocated=6 * GIB, stranded=GIB))
    assert no_free is not None
    assert [(s.part, s.size) for s in no_free.card] == [
        (Part.ALLOCATED, 6 * GIB),
        (Part.STRANDED, GIB),
        (Part.UNACCOUNTED, 9 * GIB),  # free was not printed: not "other", not zero
    ]
    assert dict(no_free.figures)["reserved by PyTorch"] == f"7.00 GiB ({DERIVED})"
    unsplit = oom_bar(OomFigures(total=8 * GIB, free=GIB, reserved=6 * GIB))
    assert unsplit is not None
    assert [s.part for s in unsplit.card] == [Part.RESERVED, Part.OTHER, Part.FREE]
    assert unsplit.summary == "a 8.00 GiB card; the message printed no request"
    assert oom_bar(OomFigures()) is None


def test_a_request_beyond_the_card_sets_the_scale() -> None:
    bar = oom_bar(OomFigures(requested=40 * GIB, total=16 * GIB, free=2 * GIB, reserved=12 * GIB))
    assert bar is not None
    assert bar.scale == 40 * GIB
    assert bar.request is not None
    assert bar.request.width == pytest.approx(100)
    assert sum(segment.width for segment in bar.card) == pytest.approx(40)
    assert bar.summary.endswith("free 2.00 GiB, short of the request by 38.00 GiB")


def test_small_figures_keep_their_digits() -> None:
    assert gib_text(int(12.5 * 2**20)) == "0.0122 GiB"
    assert gib_text(0) == "0.00 GiB"
    assert gib_text(int(22.78 * GIB)) == "22.78 GiB"


# Every real message that is an OOM (the corpus also holds negatives: illegal memory access...).
REAL_MESSAGES = [
    (path.name, report)
    for path in sorted((DATA / "oom").glob("*.txt")) + sorted((DATA / "real" / "oom").glob("*.txt"))
    if (report := parse_oom(path.read_text(errors="replace"))) is not None
]


@pytest.mark.parametrize("report", [r for _, r in REAL_MESSAGES], ids=[n for n, _ in REAL_MESSAGES])
def test_every_real_messages_bar_is_on_one_scale_with_every_printed_figure(
    report: OomReport,
) -> None:
    bar = oom_bar(figures_of(report))
    printed = [report.requested_bytes, report.total_bytes, report.free_bytes]
    if bar is None:
        assert printed == [None, None, None]
        return
    _widths_follow_sizes(bar.card, bar.scale)
    said = dict(bar.figures)
    for label, value in (
        ("requested", report.requested_bytes),
        ("free on the card", report.free_bytes),
        ("the card's total", report.total_bytes),
    ):
        assert said[label] == (NOT_PRINTED if value is None else gib_text(value))
    if report.total_bytes is not None:
        assert bar.scale >= report.total_bytes
        assert sum(segment.size for segment in bar.card) <= bar.scale


_SIZE = st.none() | st.integers(min_value=0, max_value=2**50)


@settings(max_examples=300, deadline=None)
@given(_SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _SIZE)
def test_any_figures_give_contiguous_segments_within_the_bar(
    requested: int | None,
    total: int | None,
    free: int | None,
    allocated: int | None,
    reserved: int | None,
    stranded: int | None,
) -> None:
    figures = OomFigures(requested, total, free, allocated, reserved, stranded)
    bar = oom_bar(figures)
    if bar is None:
        assert not any((requested, total, free, allocated, reserved, stranded))
        return
    assert all(segment.size > 0 for segment in bar.card)
    _widths_follow_sizes(bar.card, bar.scale)
    if bar.request is not None:
        assert 0 <= bar.request.width <= 100
    said = dict(bar.figures)
    for label, value in (("requested", requested), ("the card's total", total)):
        assert said[label] == (NOT_PRINTED if value is None else gib_text(value))
