"""The shadow-mode report on a real record: the relaunch policy would have approved under dry
run (bob's fragmentation) with what became of it and of the run afterwards, and the drain the
fleet's policy held (gpu-04) with the jobs that died on the node since; each person sees
only their own runs' rows and failures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import Engine

from daemon.store import repository as repo
from daemon.store.states import ProposalState
from tests.test_web_runs import ADMIN, DRY_RUN_HOLD, WOULD_APPROVE_REASON, Site, make_site
from tests.web_support import Answer

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users


@pytest.fixture
def site(empty_db_engine: Engine, tmp_path: Path) -> Site:
    return make_site(empty_db_engine, tmp_path)


def _section(page: Answer, heading: str) -> str:
    assert page.status_code == 200, page.text
    match = re.search(rf'<section aria-labelledby="{heading}">(.*?)</section>', page.text, re.S)
    assert match is not None
    return match.group(1)


def test_a_would_be_relaunch_with_policys_reasons_and_what_came_after(site: Site) -> None:
    relaunches = _section(site.get(ADMIN, "/shadow"), "relaunch-h")
    rows = re.findall(r"<tr>(.*?)</tr>", relaunches.split("<tbody>")[1], re.S)
    assert len(rows) == 1
    (row,) = rows
    assert '<a href="/jobs/2001">2001</a> vit sweep' in row
    assert f"proposal {site.seeded.bob_proposal}: allocator_expandable_segments" in row
    assert WOULD_APPROVE_REASON in row
    assert 'proposal now <span class="badge">proposed</span>' in row
    assert re.search(r'job <a href="/jobs/2002">2002</a>: unknown</li>', row)


def test_a_later_decision_by_a_person_is_what_happened(site: Site) -> None:
    with site.session() as session:
        repo.transition_proposal(
            session,
            proposal_id=site.seeded.bob_proposal,
            to=ProposalState.REJECTED,
            actor=repo.Actor.user("bob", 1002),
            reason="not now",
        )
        session.commit()
    relaunches = _section(site.get("bob", "/shadow"), "relaunch-h")
    assert 'proposal now <span class="badge">rejected</span> (decided by bob)' in relaunches


def test_a_held_drain_with_the_jobs_that_died_on_the_node_since(site: Site) -> None:
    drains = _section(site.get(ADMIN, "/shadow"), "drain-h")
    assert '<a href="/nodes/gpu-04">gpu-04</a>' in drains
    assert DRY_RUN_HOLD in drains
    assert "Not drained or resumed since." in drains
    died = re.findall(r'job <a href="/jobs/([0-9]+)">[0-9]+</a> of (\w+)', drains)
    assert died == [("2001", "bob"), ("2002", "bob")]


def test_each_person_sees_only_their_runs_in_the_report(site: Site) -> None:
    alices = site.get("alice", "/shadow")
    relaunches = _section(alices, "relaunch-h")
    assert "None in this time range." in relaunches
    drains = _section(alices, "drain-h")
    assert DRY_RUN_HOLD in drains  # the node's decision is the cluster's
    assert "No job died on it since." in drains  # bob's jobs are not hers to count
    assert "bob" not in alices.text


def test_the_report_keeps_to_its_time_range(site: Site) -> None:
    recent = site.get(ADMIN, "/shadow", since="1h")
    assert f"proposal {site.seeded.bob_proposal}:" in _section(recent, "relaunch-h")
    assert "None in this time range." in _section(recent, "drain-h")  # checked 2 h ago
    refused = site.get(ADMIN, "/shadow", since="yesterday-ish")
    assert refused.status_code == 400
    assert "since: &#39;yesterday-ish&#39; is neither a duration" in refused.text
    assert site.get(ADMIN, "/shadow", limit="201").status_code == 400
