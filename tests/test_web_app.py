"""The web app on a seeded SQLite record: the overview and its pause switch, the JSON status,
the headers every answer carries, a record that cannot be used, and what a hostile job name
or rationale becomes on a page."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest

from daemon.store import awaited, control
from daemon.store.engine import make_session_factory
from daemon.web.overview import incident_chart
from tests.web_support import (
    ADMIN,
    HOSTILE_NAME,
    HOSTILE_RATIONALE,
    OTHER,
    OWNER,
    WebRecord,
    web_record_at,
)

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users


@pytest.fixture
def web_record(tmp_path: Path) -> Iterator[WebRecord]:
    with web_record_at(tmp_path) as record:
        yield record


_CSRF = re.compile(r'name="csrf" value="([0-9a-f]{64})"')
_KEY = re.compile(r'name="idempotency_key" value="([A-Za-z0-9_-]{16,64})"')


def _is_paused(record: WebRecord) -> bool:
    with make_session_factory(record.engine)() as session:
        return control.is_paused(session)


def test_the_overview_shows_the_owner_her_waiting_proposal_and_not_anothers(
    web_record: WebRecord,
) -> None:
    with web_record.client() as client:
        page = client.get("/", headers=web_record.headers(OWNER))
    assert page.status_code == 200
    assert f'href="/approvals#proposal-{web_record.alices_proposal}"' in page.text
    assert f'href="/approvals#proposal-{web_record.daemons_proposal}"' not in page.text
    assert "daemon&#39;s run" not in page.text  # another's run is not listed
    assert "Your incidents by kind" in page.text
    assert 'action="/pause"' not in page.text  # the switch is for admins


def test_an_admin_sees_every_run_the_whole_chart_and_the_pause_switch(
    web_record: WebRecord,
) -> None:
    with web_record.client() as client:
        page = client.get("/", headers=web_record.headers(ADMIN))
    assert page.status_code == 200
    assert f'href="/approvals#proposal-{web_record.alices_proposal}"' in page.text
    assert f'href="/approvals#proposal-{web_record.daemons_proposal}"' in page.text
    assert "Incidents by kind" in page.text
    assert "true_oom (2)" in page.text  # the legend counts both users' incidents
    assert 'action="/pause"' in page.text


def test_a_hostile_job_name_and_rationale_are_shown_as_text(web_record: WebRecord) -> None:
    with web_record.client() as client:
        overview = client.get("/", headers=web_record.headers(OWNER))
        approvals = client.get("/approvals", headers=web_record.headers(OWNER))
    assert HOSTILE_NAME not in overview.text
    assert "&lt;script&gt;alert(&#34;name&#34;)&lt;/script&gt;" in overview.text
    assert HOSTILE_RATIONALE not in approvals.text
    assert "&lt;img src=x onerror=alert(1)&gt; keeps the global batch" in approvals.text


@pytest.mark.parametrize("path", ["/", "/approvals", "/api/status", "/healthz"])
def test_every_answer_forbids_framing_caching_and_outside_resources(
    web_record: WebRecord, path: str
) -> None:
    with web_record.client() as client:
        answers = [client.get(path, headers=web_record.headers(OWNER)), client.get(path)]
    for answer in answers:
        policy = answer.headers["content-security-policy"]
        assert "default-src 'none'" in policy
        assert "frame-ancestors 'none'" in policy
        assert "script-src" not in policy  # no script runs on any page
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["cache-control"] == "no-store"
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_healthz_needs_no_identity_and_the_pages_do(web_record: WebRecord) -> None:
    with web_record.client() as client:
        assert client.get("/healthz").text == "ok\n"
        assert client.get("/").status_code == 401
        assert client.get("/api/status").json() == {"error": "sign in through the site's proxy"}


def test_api_status_is_the_clis_document_cut_to_what_the_person_may_see(
    web_record: WebRecord,
) -> None:
    alices_lineage = web_record.proposal(web_record.alices_proposal).lineage_id
    assert alices_lineage is not None
    with make_session_factory(web_record.engine)() as session:
        awaited.note_awaited(
            session,
            slurm_job_id=990001,
            lineage_id=alices_lineage,
            now=datetime.now(UTC),
            accounting="no record yet",
        )
        session.commit()
    with web_record.client() as client:
        mine = client.get("/api/status", headers=web_record.headers(OWNER)).json()
        everything = client.get("/api/status", headers=web_record.headers(ADMIN)).json()
        nothing = client.get("/api/status", headers=web_record.headers(OTHER)).json()
        page = client.get("/", headers=web_record.headers(OWNER)).text
    assert set(mine) == {
        "paused",
        "pause",
        "dry_run",
        "polls",
        "records_in_flight",
        "active_lineages",
        "pending_approvals",
        "drains",
    }
    assert [row["job"] for row in mine["records_in_flight"]["awaited"]] == [990001]
    assert [row["job"] for row in everything["records_in_flight"]["awaited"]] == [990001]
    assert nothing["records_in_flight"]["awaited"] == []
    assert "Ended, record not yet in accounting" in page
    assert "990001" in page
    assert [row["id"] for row in mine["pending_approvals"]] == [web_record.alices_proposal]
    assert [row["owner"] for row in mine["active_lineages"]] == [OWNER]
    assert {row["id"] for row in everything["pending_approvals"]} == {
        web_record.alices_proposal,
        web_record.daemons_proposal,
    }
    assert nothing["pending_approvals"] == []
    assert nothing["active_lineages"] == []


def _pause_form(client_page_text: str) -> dict[str, str]:
    csrf = _CSRF.search(client_page_text)
    key = _KEY.search(client_page_text)
    assert csrf is not None
    assert key is not None
    return {"csrf": csrf[1], "idempotency_key": key[1], "paused": "true", "why": "maintenance"}


def test_an_admin_pauses_from_the_overview_on_the_record_via_the_web(
    web_record: WebRecord,
) -> None:
    with web_record.client() as client:
        headers = web_record.headers(ADMIN)
        form = _pause_form(client.get("/", headers=headers).text)
        done = client.post("/pause", data=form, headers=headers)
        assert done.status_code == 303
        assert done.headers["location"] == f"/?done={form['idempotency_key']}"
        after = client.get(done.headers["location"], headers=headers)
    assert _is_paused(web_record)
    assert "slurm-medic paused: proposals are recorded, nothing is acted on" in after.text
    assert "maintenance" in after.text
    [pause] = web_record.audit("pause")
    assert (pause.actor_name, pause.details["reason"]) == (ADMIN, "maintenance")
    [grounds] = web_record.audit("pause_authority")
    assert grounds.details == {"grounds": f"admin group {ADMIN}", "via": "web"}


def test_a_person_who_is_not_an_admin_cannot_pause_and_is_on_the_record(
    web_record: WebRecord,
) -> None:
    with web_record.client() as client:
        admin_page = client.get("/", headers=web_record.headers(ADMIN)).text
        form = _pause_form(admin_page)
        owner_page = client.get("/approvals", headers=web_record.headers(OWNER)).text
        csrf = _CSRF.search(owner_page)
        assert csrf is not None
        refused = client.post(
            "/pause", data={**form, "csrf": csrf[1]}, headers=web_record.headers(OWNER)
        )
    assert refused.status_code == 403
    assert "may not pause or resume" in refused.text
    assert not _is_paused(web_record)
    [refusal] = web_record.audit("pause_refused")
    assert (refusal.actor_name, refusal.details["via"]) == (OWNER, "web")


def test_a_record_that_cannot_be_used_is_answered_503_in_one_line(
    web_record: WebRecord,
) -> None:
    database = web_record.engine.url.database
    assert database is not None
    with web_record.client() as client:
        web_record.engine.dispose()
        Path(database).unlink()
        page = client.get("/", headers=web_record.headers(OWNER))
        api = client.get("/api/status", headers=web_record.headers(OWNER))
    assert page.status_code == 503
    assert database in page.text  # the command's one line names the record
    assert api.status_code == 503
    assert "Traceback" not in page.text


def test_the_chart_stacks_each_days_kinds_and_leaves_out_older_days() -> None:
    today = date(2026, 11, 24)
    noon = datetime(2026, 11, 24, 12, 0)
    occurrences = [
        (noon, "true_oom"),
        (noon, "true_oom"),
        (noon, "fragmentation"),
        (noon - timedelta(days=1), "hardware"),
        (noon - timedelta(days=30), "true_oom"),  # the 31st day back: outside
    ]
    chart = incident_chart(occurrences, today=today, days=30)
    assert len(chart.days) == 30
    assert chart.peak == 3
    last = chart.days[-1]
    assert (last.day, last.total) == (today, 3)
    assert [(segment.kind, segment.count) for segment in last.segments] == [
        ("true_oom", 2),
        ("fragmentation", 1),
    ]
    # The tallest day fills the chart; the segments stack without a gap.
    assert last.segments[0].y + last.segments[0].height == chart.height
    assert last.segments[1].y == pytest.approx(0.0)
    assert chart.days[-2].total == 1
    assert dict((kind, count) for kind, _colour, count in chart.kinds) == {
        "true_oom": 2,
        "fragmentation": 1,
        "hardware": 1,
    }


def test_every_page_of_the_nav_answers_and_marks_itself(web_record: WebRecord) -> None:
    with web_record.client() as client:
        for path in ("/", "/runs", "/approvals", "/nodes", "/shadow"):
            page = client.get(path, headers=web_record.headers(ADMIN))
            assert page.status_code == 200, path
            assert f'<a href="{path}" aria-current="page">' in page.text


def test_a_site_may_let_everyone_see_every_run_but_not_decide(tmp_path: Path) -> None:
    with web_record_at(tmp_path) as record:
        config = record.config.read_text().replace("[web]\n", "[web]\neveryone_sees_all = true\n")
        record.config.write_text(config)
        with record.client() as client:
            status = client.get("/api/status", headers=record.headers(OTHER)).json()
            approvals = client.get("/approvals", headers=record.headers(OTHER))
    assert {row["id"] for row in status["pending_approvals"]} == {
        record.alices_proposal,
        record.daemons_proposal,
    }
    assert "/approve" not in approvals.text
    assert "No proposal waits for you." in approvals.text


def test_a_body_too_big_is_refused_unread_whether_announced_or_chunked(
    web_record: WebRecord,
) -> None:
    client = web_record.client()
    url = f"/approvals/{web_record.alices_proposal}/approve"
    big = b"comment=" + b"x" * (64 * 1024)
    announced = client.post(url, content=big, headers=web_record.headers(OWNER))
    assert announced.status_code == 413

    def chunks() -> Iterator[bytes]:
        for _ in range(200):
            yield b"x" * 1024

    chunked = client.post(
        url,
        content=chunks(),
        headers={**web_record.headers(OWNER), "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert chunked.status_code == 413
    assert web_record.proposal(web_record.alices_proposal).state == "proposed"
    assert web_record.web_requests() == []
