"""Whatever a person types into the page's addresses, the page answers it or says what is
wrong with it (400, 404), never fails (500): the filters of the runs, the history, the shadow
report, the references of `show`, node names, a form's `done` key, the forwarder's prefix."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.web_support import ADMIN, OWNER, WebRecord, web_record_at

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

# 307: "/nodes/" is sent on to "/nodes".
ANSWERED = {200, 303, 307, 400, 404}
# Text a person could type, odd Unicode, controls and NULs included; kept short.
typed = st.text(max_size=40)
# What a header can carry (HTTP clients send ASCII).
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@pytest.fixture(scope="module")
def web_record(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebRecord]:
    with web_record_at(tmp_path_factory.mktemp("web-fuzz")) as record:
        yield record


@pytest.fixture(scope="module")
def client(web_record: WebRecord) -> TestClient:
    return web_record.client()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/runs", "/api/history", "/shadow", "/"]),
    params=st.dictionaries(
        st.sampled_from(["since", "until", "user", "kind", "state", "limit", "older_than", "done"]),
        typed,
        max_size=4,
    ),
    who=st.sampled_from([OWNER, ADMIN]),
)
def test_any_filter_is_answered_or_refused_never_a_failure(
    client: TestClient, web_record: WebRecord, path: str, params: dict[str, str], who: str
) -> None:
    answer = client.get(f"{path}?{urlencode(params)}", headers=web_record.headers(who))
    assert answer.status_code in ANSWERED, (path, params, answer.text[:300])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    template=st.sampled_from(["/api/show/{}", "/nodes/{}", "/runs/{}", "/jobs/{}"]),
    reference=typed,
    prefix=header_text,
)
def test_any_reference_or_prefix_is_answered_or_refused_never_a_failure(
    client: TestClient, web_record: WebRecord, template: str, reference: str, prefix: str
) -> None:
    headers = {**web_record.headers(ADMIN), "X-Forwarded-Prefix": prefix}
    answer = client.get(template.format(quote(reference, safe="")), headers=headers)
    assert answer.status_code in ANSWERED, (template, reference, answer.text[:300])
