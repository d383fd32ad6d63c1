"""Whatever body a client posts, the page answers it or says what is wrong with it (400,
403, 413, 415), never fails (500): JSON nested deeper than the parser's recursion limit
(`[[[[...]]]]`, 16 KB of it) to the API, and odd form bodies to every form."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.web_support import ADMIN, OWNER, PROXY, WebRecord, web_record_at

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

REFUSED = {400, 403, 413, 415}
_CSRF = re.compile(r'name="csrf" value="([0-9a-f]{64})"')
NESTED = b"[" * 8192 + b"]" * 8192  # 16 KB, as the finding sent


@pytest.fixture(scope="module")
def web_record(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebRecord]:
    with web_record_at(tmp_path_factory.mktemp("web-bodies")) as record:
        yield record


@pytest.fixture(scope="module")
def client(web_record: WebRecord) -> TestClient:
    """A client that sees a 500 as an answer, not as the app's exception."""
    return TestClient(
        web_record.app(), client=PROXY, follow_redirects=False, raise_server_exceptions=False
    )


@pytest.mark.parametrize(
    "body",
    [
        NESTED,
        b'{"comment": ' + b"[" * 7000 + b"]" * 7000 + b"}",
        b'{"comment": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2000 + b"}",
        b'{"comment": "\xff\xfe"}',
        b'{"comment": ' + b"9" * 15000 + b"}",
        b'{"comment": NaN}',
        b"\x00" * 100,
    ],
    ids=["arrays", "arrays-in-object", "objects", "bad-utf8", "long-number", "nan", "nuls"],
)
@pytest.mark.parametrize("verb", ["approve", "reject"])
def test_an_api_body_that_is_not_a_flat_object_is_a_clear_400(
    client: TestClient, web_record: WebRecord, body: bytes, verb: str
) -> None:
    answer = client.post(
        f"/api/proposals/{web_record.alices_proposal}/{verb}",
        content=body,
        headers={
            **web_record.headers(OWNER),
            "Content-Type": "application/json",
            "Idempotency-Key": "nested-key-0123456789",
        },
    )
    assert answer.status_code == 400, answer.text[:200]
    assert answer.json()["error"]


def test_the_nested_arrays_say_why(client: TestClient, web_record: WebRecord) -> None:
    answer = client.post(
        f"/api/proposals/{web_record.alices_proposal}/approve",
        content=NESTED,
        headers={
            **web_record.headers(OWNER),
            "Content-Type": "application/json",
            "Idempotency-Key": "nested-key-0123456789",
        },
    )
    assert answer.json() == {"error": "the body's JSON nests too deeply"}


FORM_BODIES = [
    ("application/x-www-form-urlencoded", b"comment=" + b"%5B" * 5000),
    ("application/x-www-form-urlencoded", b"comment=\xff\xfe&idempotency_key=%ff%fe"),
    ("application/x-www-form-urlencoded", b"&".join(b"f%d=1" % i for i in range(2000))),
    ("application/x-www-form-urlencoded", b"%" * 1000),
    ("multipart/form-data; boundary=x", b"--x\r\ngarbage"),
    ("multipart/form-data", b"--x\r\n"),
    (
        "multipart/form-data; boundary=x",
        b'--x\r\nContent-Disposition: form-data; name="comment"; filename="a"\r\n'
        b"\r\nx\r\n--x--\r\n",
    ),
    ("application/json", NESTED),
    ("text/plain", NESTED),
]


@pytest.mark.parametrize(("content_type", "body"), FORM_BODIES)
@pytest.mark.parametrize("path", ["/approvals/{proposal}/reject", "/pause", "/nodes/gpu-01/resume"])
def test_an_odd_form_body_is_refused_never_a_failure(
    client: TestClient, web_record: WebRecord, content_type: str, body: bytes, path: str
) -> None:
    answer = client.post(
        path.format(proposal=web_record.daemons_proposal),
        content=body,
        headers={**web_record.headers(ADMIN), "Content-Type": content_type},
    )
    assert answer.status_code in REFUSED, answer.text[:200]


def test_a_form_with_brackets_and_stray_fields_is_acted_on(
    client: TestClient, web_record: WebRecord
) -> None:
    page = client.get("/approvals", headers=web_record.headers(ADMIN))
    token = _CSRF.search(page.text)
    assert token is not None
    fields = {f"stray{i}": "[" * 50 for i in range(200)}
    answer = client.post(
        f"/approvals/{web_record.daemons_proposal}/reject",
        data={
            **fields,
            "csrf": token[1],
            "idempotency_key": "bracket-key-0123456789",
            "comment": "[" * 900 + "]" * 900,
        },
        headers=web_record.headers(ADMIN),
    )
    assert answer.status_code == 303, answer.text[:200]
