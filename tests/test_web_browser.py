"""The web page in a real browser: Debian's chromium (Playwright) against the real
`slurm-medic web` process on a seeded SQLite record, logged in as a site's proxy would log
people in (tests/browser.py). One browser and one server for the module.

What a person meets: nobody is let in without the proxy's word; alice sees her waiting
approval and her run's OOM as a bar with its numbers; she approves on the page and the record
says so, once, even when the same form arrives twice; bob does not see alice's run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from playwright.sync_api import Browser, Locator, Page, Request
from sqlalchemy import select

from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import AuditEvent, Proposal
from daemon.store.settings import StoreSettings
from tests.browser import (
    SeededRecord,
    WebServer,
    approve_on_page,
    chromium,
    make_record,
    page_as,
    seed_record,
    web_server,
)

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = [pytest.mark.users, pytest.mark.chromium]

COMMENT = "halving is fine <img src=x id=injected> the global batch is kept"


@dataclass(frozen=True)
class Site:
    server: WebServer
    url: str
    seeded: SeededRecord


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    work_dir = tmp_path_factory.mktemp("web")
    url = make_record(work_dir / "medic.db")
    seeded = seed_record(url)
    with web_server(work_dir / "server", f'[store]\nurl = "{url}"\n') as server:
        yield Site(server, url, seeded)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as running:
        yield running


def _status(page: Page, url: str) -> int:
    """Open `url` in the page; the HTTP status it was answered with."""
    response = page.goto(url)
    assert response is not None
    return response.status


def _width(element: Locator) -> float:
    """The element's width as the browser laid it out, in CSS pixels."""
    box = element.bounding_box()
    assert box is not None, "not rendered"
    return box["width"]


def _text(page: Page) -> str:
    return page.locator("body").inner_text()


def test_nobody_is_let_in_without_the_proxys_word(site: Site, browser: Browser) -> None:
    context, page = page_as(browser, None, site.server.secret)
    with context:
        assert _status(page, site.server.url("/")) == 401
        assert "who are you" in _text(page)
        assert "alice" not in _text(page)
        # A local user who connects straight to the port can name anyone, but has no secret.
        claimed = context.request.get(site.server.url("/"), headers={"X-Forwarded-User": "alice"})
        assert claimed.status == 401
        wrong = context.request.get(
            site.server.url("/"),
            headers={"X-Forwarded-User": "alice", "X-Slurm-Medic-Proxy-Secret": "guess" * 8},
        )
        assert wrong.status == 401


def test_alice_sees_her_waiting_approval_and_her_runs_oom_bar(site: Site, browser: Browser) -> None:
    seeded = site.seeded
    context, page = page_as(browser, "alice", site.server.secret)
    with context:
        assert _status(page, site.server.url("/")) == 200
        waiting = page.locator("section[aria-labelledby=pending-h] tbody tr")
        assert waiting.count() == 1
        cells = waiting.locator("td").all_inner_texts()
        assert cells[:5] == [
            str(seeded.waiting_proposal),
            str(seeded.waiting_job),
            "alice",
            "true_oom",
            "kept",
        ]
        assert _status(page, site.server.url(f"/runs/{seeded.waiting_lineage}")) == 200
        bar = page.locator("figure.oom")
        assert bar.count() == 1
        assert bar.locator("figcaption").inner_text() == (
            "3.00 GiB requested on a 79.11 GiB card; free 0.44 GiB + stranded 1.15 GiB"
            " = 1.59 GiB, short of the request by 1.41 GiB"
        )
        drawn = bar.locator("svg.oom-bar rect")
        assert drawn.locator("title").all_text_contents() == [
            "allocated by PyTorch: 75.20 GiB",
            "stranded (reserved but unallocated): 1.15 GiB",
            "in use outside PyTorch's reserve: 2.32 GiB",
            "free: 0.44 GiB",
            "requested: 3.00 GiB",
        ]
        # Drawn on one scale, the card's 79.11 GiB: PyTorch's 75.20 GiB is 95 % of the bar's
        # width on the screen, the 3.00 GiB request under it 3.8 %.
        whole = _width(bar.locator("svg.oom-bar"))
        assert abs(_width(drawn.first) / whole - 75.20 / 79.11) < 0.01
        assert abs(_width(drawn.last) / whole - 3.00 / 79.11) < 0.01


def test_alice_approves_on_the_page_once(site: Site, browser: Browser) -> None:
    seeded = site.seeded
    context, page = page_as(browser, "alice", site.server.secret)
    with context:
        with page.expect_request(_posted) as sent:
            said = approve_on_page(page, site.server, seeded.waiting_proposal, COMMENT)
        assert said == f"proposal {seeded.waiting_proposal} approved by alice (job owner)"
        assert page.locator(f'form[action*="/approvals/{seeded.waiting_proposal}/"]').count() == 0
        # Her comment on the run's story, as she wrote it: text, never markup.
        page.goto(site.server.url(f"/runs/{seeded.waiting_lineage}"))
        assert COMMENT in _text(page)
        assert page.locator("#injected").count() == 0
        # The same form again (a double click, a browser's retry): the first answer, replayed.
        posted = sent.value
        form = parse_qs(posted.post_data or "")
        again = context.request.post(posted.url, form=_single(form))
        assert again.status == 200
        assert f"done={form['idempotency_key'][0]}" in again.url
        assert said in again.text()
        # A new key for the same decision is a new request, and the proposal no longer waits.
        fresh = context.request.post(
            posted.url, form=_single(form) | {"idempotency_key": "a-fresh-key-0123456789"}
        )
        assert fresh.status == 409
    proposal, approvals, web_decisions = _decision_on_record(site.url, seeded.waiting_proposal)
    assert proposal.state == "approved"
    assert proposal.decided_by == "alice"
    assert [(event.actor_name, event.details["reason"]) for event in approvals] == [
        ("alice", COMMENT)
    ]
    assert len(web_decisions) == 1


def test_bob_does_not_see_alices_run(site: Site, browser: Browser) -> None:
    seeded = site.seeded
    context, page = page_as(browser, "bob", site.server.secret)
    with context:
        page.goto(site.server.url("/"))
        overview = _text(page)
        assert "bob" in overview
        assert str(seeded.waiting_job) not in overview
        assert "llama-7b" not in overview
        assert _status(page, site.server.url("/runs?since=30d")) == 200
        rows = page.locator("table tbody tr").all_inner_texts()
        assert len(rows) == 1
        assert str(seeded.bob_job) in rows[0]
        assert "alice" not in _text(page)
        assert _status(page, site.server.url(f"/runs/{seeded.waiting_lineage}")) == 404
        assert "llama-7b" not in _text(page)
        assert _status(page, site.server.url(f"/runs/{seeded.bob_lineage}")) == 200
        assert "vit-huge sweep" in _text(page)


def _posted(request: Request) -> bool:
    return request.method == "POST"


def _single(form: dict[str, list[str]]) -> dict[str, str | float | bool]:
    """A parsed form's fields, one value each, as Playwright posts them."""
    return {name: values[0] for name, values in form.items()}


def _decision_on_record(
    url: str, proposal_id: int
) -> tuple[Proposal, list[AuditEvent], list[AuditEvent]]:
    """The proposal, its approvals, and the decisions the audit trail says the web made."""
    engine = make_engine(StoreSettings(url=url))
    try:
        with make_session_factory(engine, read_only=True)() as session:
            proposal = session.get(Proposal, proposal_id)
            assert proposal is not None
            events = list(
                session.scalars(
                    select(AuditEvent)
                    .where(
                        AuditEvent.subject_type == "proposal",
                        AuditEvent.subject_id == str(proposal_id),
                    )
                    .order_by(AuditEvent.id)
                )
            )
            session.expunge_all()
    finally:
        engine.dispose()
    approvals = [event for event in events if event.verb == "proposal_approved"]
    web_decisions = [
        event
        for event in events
        if event.verb == "decision_authority" and event.details.get("via") == "web"
    ]
    return proposal, approvals, web_decisions


def test_the_harness_refuses_a_missing_chromium(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("tests.browser.CHROMIUM", tmp_path / "chromium")
    with pytest.raises(RuntimeError, match="install-system-packages"), chromium():
        pass
