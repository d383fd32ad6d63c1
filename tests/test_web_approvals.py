"""Approvals on the web page and through the JSON API, on a seeded SQLite record: the CLI's
authority and audit events (plus `via: "web"`), the CSRF token and the request's origin,
and an idempotency key that makes a form sent twice act once."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from daemon.store.states import ProposalState
from daemon.web.context import csrf_token
from daemon.web.identity import person_named
from tests.web_support import (
    ADMIN,
    HOSTILE_RATIONALE,
    OTHER,
    OWNER,
    PROXY,
    Answer,
    WebRecord,
    web_record_at,
)

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

_FORM = re.compile(
    r'<form class="inline" method="post" action="/approvals/(?P<id>[0-9]+)/(?P<verb>[a-z]+)">\s*'
    r'<input type="hidden" name="csrf" value="(?P<csrf>[0-9a-f]{64})">\s*'
    r'<input type="hidden" name="idempotency_key" value="(?P<key>[A-Za-z0-9_-]{16,64})">'
)


@pytest.fixture
def web_record(tmp_path: Path) -> Iterator[WebRecord]:
    with web_record_at(tmp_path) as record:
        yield record


def _forms(
    client: TestClient, record: WebRecord, user: str
) -> dict[tuple[int, str], dict[str, str]]:
    """The approvals page's forms for `user`: (proposal, verb) -> the hidden fields."""
    page = client.get("/approvals", headers=record.headers(user))
    assert page.status_code == 200
    return {
        (int(match["id"]), match["verb"]): {
            "csrf": match["csrf"],
            "idempotency_key": match["key"],
        }
        for match in _FORM.finditer(page.text)
    }


def _post(
    client: TestClient,
    record: WebRecord,
    user: str,
    proposal_id: int,
    verb: str,
    fields: dict[str, str],
    **headers: str,
) -> Answer:
    return client.post(
        f"/approvals/{proposal_id}/{verb}",
        data=fields,
        headers={**record.headers(user), **headers},
    )


def test_the_page_lists_only_what_the_person_may_decide(web_record: WebRecord) -> None:
    with web_record.client() as client:
        owners = _forms(client, web_record, OWNER)
        admins = _forms(client, web_record, ADMIN)
        others = _forms(client, web_record, OTHER)
    alices, daemons = web_record.alices_proposal, web_record.daemons_proposal
    assert set(owners) == {(alices, "approve"), (alices, "reject")}
    assert set(admins) == {
        (alices, "approve"),
        (alices, "reject"),
        (daemons, "approve"),
        (daemons, "reject"),
    }
    assert others == {}
    # Each form has its own key: two forms never share an answer.
    assert len({fields["idempotency_key"] for fields in admins.values()}) == 4


def test_the_owner_approves_on_the_page_as_the_cli_would_via_the_web(
    web_record: WebRecord,
) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        fields = _forms(client, web_record, OWNER)[proposal_id, "approve"]
        done = _post(
            client,
            web_record,
            OWNER,
            proposal_id,
            "approve",
            {**fields, "comment": "go <b>ahead</b>"},
        )
        assert done.status_code == 303
        assert done.headers["location"] == f"/approvals?done={fields['idempotency_key']}"
        after = client.get(done.headers["location"], headers=web_record.headers(OWNER))
        # The flash is its own person's: another who follows the link sees none.
        admins_view = client.get(done.headers["location"], headers=web_record.headers(ADMIN))
    proposal = web_record.proposal(proposal_id)
    assert (proposal.state, proposal.decided_by) == (ProposalState.APPROVED.value, OWNER)
    [transition] = web_record.audit("proposal_approved")
    assert (transition.actor_name, transition.details["reason"]) == (OWNER, "go <b>ahead</b>")
    [grounds] = web_record.audit("decision_authority")
    assert grounds.details == {"decision": "approved", "grounds": "job owner", "via": "web"}
    flash = f"proposal {proposal_id} approved by {OWNER} (job owner)"
    assert flash in after.text
    assert flash not in admins_view.text
    assert f"/approvals/{proposal_id}/approve" not in after.text  # no longer waiting


def test_an_admin_decides_anothers_proposal_on_the_grounds_of_the_group(
    web_record: WebRecord,
) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        fields = _forms(client, web_record, ADMIN)[proposal_id, "reject"]
        done = _post(
            client,
            web_record,
            ADMIN,
            proposal_id,
            "reject",
            {**fields, "comment": "changes too much"},
        )
    assert done.status_code == 303
    proposal = web_record.proposal(proposal_id)
    assert (proposal.state, proposal.decided_by) == (ProposalState.REJECTED.value, ADMIN)
    [grounds] = web_record.audit("decision_authority")
    assert grounds.details["grounds"] == f"admin group {ADMIN}"


def test_a_rejection_needs_a_reason(web_record: WebRecord) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        fields = _forms(client, web_record, OWNER)[proposal_id, "reject"]
        refused = _post(
            client, web_record, OWNER, proposal_id, "reject", {**fields, "comment": "  "}
        )
    assert refused.status_code == 400
    assert "a rejection needs a reason" in refused.text
    assert web_record.proposal(proposal_id).state == ProposalState.PROPOSED.value
    assert web_record.audit("proposal_rejected") == []


def test_someone_who_is_neither_owner_nor_admin_is_refused_on_the_record(
    web_record: WebRecord,
) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        owners = _forms(client, web_record, OWNER)[proposal_id, "approve"]
        # With their own valid token: the form was not forged, the person is not allowed.
        refused = _post(
            client,
            web_record,
            OTHER,
            proposal_id,
            "approve",
            {**owners, "csrf": _token_of(client, OTHER)},
        )
    assert refused.status_code == 403
    assert f"{OTHER} may not approve proposal {proposal_id}" in refused.text
    assert web_record.proposal(proposal_id).state == ProposalState.PROPOSED.value
    [refusal] = web_record.audit("approve_refused")
    assert refusal.actor_name == OTHER
    assert refusal.details == {
        "owner": OWNER,
        "reason": "neither the job owner nor an admin",
        "via": "web",
    }


def _token_of(client: TestClient, user: str) -> str:
    """A person's CSRF token, as the forms of a page rendered for them carry it."""
    scope = {"type": "http", "app": client.app, "state": {"person": person_named(user)}}
    return csrf_token(Request(scope))


@pytest.mark.parametrize(
    ("change", "headers"),
    [
        ({"csrf": ""}, {}),
        ({"csrf": "0" * 64}, {}),
        (None, {}),
        ({}, {"Sec-Fetch-Site": "cross-site"}),
        ({}, {"Sec-Fetch-Site": "same-site"}),
        ({}, {"Origin": "https://evil.example"}),
        ({}, {"Origin": "null"}),
    ],
    ids=["empty", "wrong", "missing", "cross-site", "same-site", "other-origin", "null-origin"],
)
def test_a_forged_request_is_refused_and_changes_nothing(
    web_record: WebRecord, change: dict[str, str] | None, headers: dict[str, str]
) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        fields = _forms(client, web_record, OWNER)[proposal_id, "approve"]
        sent = {key: value for key, value in fields.items() if change is not None or key != "csrf"}
        refused = _post(
            client, web_record, OWNER, proposal_id, "approve", {**sent, **(change or {})}, **headers
        )
    assert refused.status_code == 403
    assert web_record.proposal(proposal_id).state == ProposalState.PROPOSED.value
    assert web_record.audit("proposal_approved") == []
    assert web_record.audit("approve_refused") == []
    assert web_record.web_requests() == []


@pytest.mark.parametrize(
    ("origin", "host", "status"),
    [
        ("http://testserver", None, 303),
        ("https://testserver:8443", None, 303),  # nginx's `Host: $host` drops the port
        ("https://medic.example:8443", "medic.example:8443", 303),
        ("https://medic.example:9443", "medic.example:8443", 403),
        ("https://testserver.evil.example", None, 403),
        ("https://evil.example/testserver", None, 403),
    ],
)
def test_the_origin_must_name_this_host(
    web_record: WebRecord, origin: str, host: str | None, status: int
) -> None:
    proposal_id = web_record.alices_proposal
    extra = {"Origin": origin, "Sec-Fetch-Site": "same-origin"}
    if host is not None:
        extra["Host"] = host
    with web_record.client() as client:
        fields = _forms(client, web_record, OWNER)[proposal_id, "approve"]
        answer = _post(client, web_record, OWNER, proposal_id, "approve", fields, **extra)
    assert answer.status_code == status
    approved = web_record.proposal(proposal_id).state == ProposalState.APPROVED.value
    assert approved == (status == 303)


def test_a_form_sent_twice_acts_once_and_answers_the_same(web_record: WebRecord) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        fields = {**_forms(client, web_record, OWNER)[proposal_id, "approve"], "comment": "ok"}
        first = _post(client, web_record, OWNER, proposal_id, "approve", fields)
        second = _post(client, web_record, OWNER, proposal_id, "approve", fields)
    assert (first.status_code, second.status_code) == (303, 303)
    assert first.headers["location"] == second.headers["location"]
    assert len(web_record.audit("proposal_approved")) == 1
    assert len(web_record.audit("decision_authority")) == 1
    [stored] = web_record.web_requests()
    assert (stored.actor_name, stored.target, stored.status) == (
        OWNER,
        f"POST /approvals/{proposal_id}/approve",
        200,
    )


def test_a_double_click_racing_itself_acts_once(web_record: WebRecord) -> None:
    """Two requests with one key at once, on two connections to one server: whichever order
    they meet the record in, one decision is made and both get its answer."""
    proposal_id = web_record.alices_proposal
    app = web_record.app()
    with TestClient(app, client=PROXY) as first, TestClient(app, client=PROXY) as second:
        fields = {**_forms(first, web_record, OWNER)[proposal_id, "approve"], "comment": "go"}
        start = threading.Barrier(2)

        def click(client: TestClient) -> tuple[int, str]:
            start.wait()
            answer = client.post(
                f"/approvals/{proposal_id}/approve",
                data=fields,
                headers=web_record.headers(OWNER),
                follow_redirects=False,
            )
            return answer.status_code, answer.headers.get("location", "")

        with ThreadPoolExecutor(max_workers=2) as pool:
            answers = list(pool.map(click, (first, second)))
    assert answers == [(303, f"/approvals?done={fields['idempotency_key']}")] * 2
    assert len(web_record.audit("proposal_approved")) == 1
    assert len(web_record.web_requests()) == 1


def test_a_key_used_by_someone_else_or_for_another_request_is_refused(
    web_record: WebRecord,
) -> None:
    alices, daemons = web_record.alices_proposal, web_record.daemons_proposal
    with web_record.client() as client:
        admins = _forms(client, web_record, ADMIN)
        used = admins[daemons, "approve"]
        assert _post(client, web_record, ADMIN, daemons, "approve", used).status_code == 303
        # The same key for another proposal: a 409, not the stored answer.
        elsewhere = _post(
            client,
            web_record,
            ADMIN,
            alices,
            "approve",
            {**admins[alices, "approve"], "idempotency_key": used["idempotency_key"]},
        )
        # The same key sent by another person: a 409 as well.
        owners = _forms(client, web_record, OWNER)[alices, "approve"]
        stolen = _post(
            client,
            web_record,
            OWNER,
            alices,
            "approve",
            {**owners, "idempotency_key": used["idempotency_key"]},
        )
    assert (elsewhere.status_code, stolen.status_code) == (409, 409)
    assert web_record.proposal(alices).state == ProposalState.PROPOSED.value


def test_a_decided_proposal_is_answered_409(web_record: WebRecord) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        forms = _forms(client, web_record, OWNER)
        _post(client, web_record, OWNER, proposal_id, "approve", forms[proposal_id, "approve"])
        late = _post(
            client,
            web_record,
            OWNER,
            proposal_id,
            "reject",
            {**forms[proposal_id, "reject"], "comment": "too late"},
        )
    assert late.status_code == 409
    assert "is approved" in late.text
    assert web_record.proposal(proposal_id).state == ProposalState.APPROVED.value


def test_the_rationale_is_escaped_on_the_approvals_page(web_record: WebRecord) -> None:
    with web_record.client() as client:
        page = client.get("/approvals", headers=web_record.headers(OWNER))
    assert HOSTILE_RATIONALE not in page.text
    assert "&lt;img src=x onerror=alert(1)&gt;" in page.text


# ---------------------------------------------------------------- the JSON API


def _api(
    client: TestClient, record: WebRecord, user: str, path: str, body: object, **headers: str
) -> Answer:
    return client.post(
        path,
        content=json.dumps(body),
        headers={"Content-Type": "application/json", **record.headers(user), **headers},
    )


def test_the_api_approves_with_the_clis_document_once_per_key(web_record: WebRecord) -> None:
    proposal_id = web_record.alices_proposal
    path = f"/api/proposals/{proposal_id}/approve"
    key = "script-key-0123456789"
    with web_record.client() as client:
        first = _api(client, web_record, OWNER, path, {"comment": "ok"}, **{"Idempotency-Key": key})
        again = _api(client, web_record, OWNER, path, {"comment": "ok"}, **{"Idempotency-Key": key})
    assert first.status_code == 200
    assert first.json() == again.json()
    assert first.json() == {
        "proposal": proposal_id,
        "state": "approved",
        "by": OWNER,
        "uid": 1001,
        "grounds": "job owner",
        "reason": "ok",
    }
    assert web_record.proposal(proposal_id).state == ProposalState.APPROVED.value
    assert len(web_record.audit("proposal_approved")) == 1


def test_the_api_rejects_with_why(web_record: WebRecord) -> None:
    proposal_id = web_record.daemons_proposal
    with web_record.client() as client:
        answer = _api(
            client,
            web_record,
            ADMIN,
            f"/api/proposals/{proposal_id}/reject",
            {"why": "not now"},
            **{"Idempotency-Key": "reject-key-0123456789"},
        )
        unsaid = _api(
            client,
            web_record,
            ADMIN,
            f"/api/proposals/{proposal_id}/reject",
            {},
            **{"Idempotency-Key": "reject-key-9876543210"},
        )
    assert answer.status_code == 200
    assert (answer.json()["state"], answer.json()["reason"]) == ("rejected", "not now")
    assert unsaid.status_code == 400  # the stored answer of a new key: no reason given


@pytest.mark.parametrize(
    ("content_type", "key", "status"),
    [
        ("application/x-www-form-urlencoded", "form-key-0123456789", 415),
        ("text/plain", "text-key-0123456789", 415),
        ("application/json", None, 400),
        ("application/json", "short", 400),
    ],
)
def test_the_api_refuses_what_a_cross_site_form_could_send_and_a_missing_key(
    web_record: WebRecord, content_type: str, key: str | None, status: int
) -> None:
    proposal_id = web_record.alices_proposal
    headers = {**web_record.headers(OWNER), "Content-Type": content_type}
    if key is not None:
        headers["Idempotency-Key"] = key
    with web_record.client() as client:
        answer = client.post(
            f"/api/proposals/{proposal_id}/approve", content=b'{"comment": "x"}', headers=headers
        )
    assert answer.status_code == status
    assert web_record.proposal(proposal_id).state == ProposalState.PROPOSED.value


def test_the_api_refuses_a_non_owner_on_the_record(web_record: WebRecord) -> None:
    proposal_id = web_record.alices_proposal
    with web_record.client() as client:
        answer = _api(
            client,
            web_record,
            OTHER,
            f"/api/proposals/{proposal_id}/approve",
            {},
            **{"Idempotency-Key": "nobody-key-0123456789"},
        )
        missing = _api(
            client,
            web_record,
            OTHER,
            "/api/proposals/999/approve",
            {},
            **{"Idempotency-Key": "nobody-key-9876543210"},
        )
    assert answer.status_code == 403
    assert missing.status_code == 404
    [refusal] = web_record.audit("approve_refused")
    assert (refusal.actor_name, refusal.details["via"]) == (OTHER, "web")
