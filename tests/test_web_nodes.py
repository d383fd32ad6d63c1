"""The nodes pages on a real record: the nodes and drains in force for everyone, a node's
story without the incidents of runs the person may not see, `/api/nodes` equal to `nodes
--json`, and the resume form: refused to a non-admin (and on the record), done for an admin
through the Slurm backend, whose seam (the command runner) is the only fake: it answers
`scontrol show node` as slurmctld would and records every argv."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from sqlalchemy import Engine, select
from starlette.requests import Request
from starlette.testclient import TestClient

from daemon.commands import sweep as fleet_commands
from daemon.commands.context import CommandContext
from daemon.commands.people import Person
from daemon.process import CommandResult
from daemon.slurm.backend import SlurmBackend, SlurmCli
from daemon.store import control
from daemon.store.models import AuditEvent, NodeEvent
from daemon.web.context import csrf_token
from tests.test_web_runs import ADMIN, DATA, Site, make_site
from tests.web_support import Answer

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

DRAINED_LINE = (DATA / "slurm" / "dbv0.0.38" / "scontrol-show-node-drained.txt").read_text()
RESUME = ("scontrol", "update", "NodeName=gpu-02", "State=RESUME")


@dataclass
class Slurmctld:
    """The runner under SlurmCli: `scontrol show node` answers with the node drained by
    slurm-medic; every argv is kept."""

    calls: list[tuple[str, ...]] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        self.calls.append(tuple(argv))
        out = ""
        if argv[:4] == ["scontrol", "--oneliner", "show", "node"]:
            out = DRAINED_LINE.replace("gpu-03", argv[4])
        return CommandResult(tuple(argv), 0, out, "", 0.01)


@pytest.fixture
def site(empty_db_engine: Engine, tmp_path: Path) -> Site:
    return make_site(empty_db_engine, tmp_path)


@pytest.fixture
def slurmctld(monkeypatch: pytest.MonkeyPatch) -> Slurmctld:
    runner = Slurmctld()

    def backend(_context: CommandContext) -> SlurmBackend:
        return SlurmCli(runner=runner, attempts=1)

    monkeypatch.setattr(fleet_commands, "slurm_backend", backend)
    return runner


def _form_of(page: Answer, node: str) -> dict[str, str]:
    """The hidden fields of the page's resume form for `node`."""
    form = re.search(rf'<form[^>]*action="/nodes/{node}/resume">(.*?)</form>', page.text, re.S)
    assert form is not None, page.text
    fields = dict(re.findall(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)">', form[1]))
    return fields


def _token_for(client: TestClient, name: str, uid: int) -> str:
    """The CSRF token the app would put in `name`'s forms (the app renders none for a
    non-admin: a forged form must fail on authority, not on its token)."""
    person = Person(name=name, uid=uid, groups=frozenset({name}), is_root=False)
    request = SimpleNamespace(state=SimpleNamespace(person=person), app=client.app)
    return csrf_token(cast(Request, request))


def _audit(site: Site, verb: str) -> list[AuditEvent]:
    with site.session() as session:
        return list(session.scalars(select(AuditEvent).where(AuditEvent.verb == verb)))


def test_nodes_shows_the_drains_in_force_and_last_checks_to_everyone(site: Site) -> None:
    page = site.get("alice", "/nodes")
    assert page.status_code == 200
    assert '<a href="/nodes/gpu-02">gpu-02</a>' in page.text
    assert "medic: XID 79 on GPU 3" in page.text
    assert "GPU 5: row remapping failure occurred" in page.text
    assert "/resume" not in page.text  # no resume form for a non-admin
    admin = site.get(ADMIN, "/nodes")
    assert set(_form_of(admin, "gpu-02")) == {"csrf", "idempotency_key"}
    assert "/nodes/gpu-04/resume" not in admin.text  # checked, not drained


def test_api_nodes_is_the_clis_nodes_json(site: Site) -> None:
    document = site.get("bob", "/api/nodes").json()
    assert document == site.cli_json("nodes")
    assert [row["node"] for row in document["nodes"]] == ["gpu-02", "gpu-04"]


def test_a_nodes_story_leaves_out_runs_the_person_may_not_see(site: Site) -> None:
    admin = site.get(ADMIN, "/nodes/gpu-02")
    assert admin.status_code == 200
    assert 'job <a href="/jobs/1001">1001</a> of alice died: true_oom' in admin.text
    bobs = site.get("bob", "/nodes/gpu-02")
    assert "medic: XID 79 on GPU 3" in bobs.text
    assert "1001" not in bobs.text
    assert "alice" not in bobs.text
    for missing in ("/nodes/gpu-99", "/nodes/gpu;reboot"):
        page = site.get(ADMIN, missing)
        assert page.status_code == 404
        assert "is not in the record" in page.text


def test_resume_is_refused_to_a_non_admin_and_the_attempt_is_recorded(
    site: Site, slurmctld: Slurmctld
) -> None:
    client = site.client()
    form = {
        "csrf": _token_for(client, "alice", 1001),
        "idempotency_key": "alice-tries-0123456789",
        "why": "I need it",
    }
    answer = client.post("/nodes/gpu-02/resume", data=form, headers=site.headers("alice"))
    assert answer.status_code == 403
    assert "alice may not resume a node: root or policy.admin_groups only" in answer.text
    assert slurmctld.calls == []
    refused = _audit(site, "node_resume_refused")
    assert [(e.actor_name, e.subject_id, e.details["why"]) for e in refused] == [
        ("alice", "gpu-02", "I need it")
    ]
    with site.session() as session:
        assert [event.node for event in control.drains_in_force(session)] == ["gpu-02"]


def test_an_admin_resumes_through_scontrol_once_per_form(site: Site, slurmctld: Slurmctld) -> None:
    client = site.client()
    form = {**_form_of(client.get("/nodes", headers=site.headers(ADMIN)), "gpu-02"), "why": "fixed"}
    answer = client.post("/nodes/gpu-02/resume", data=form, headers=site.headers(ADMIN))
    assert answer.status_code == 200, answer.text
    assert "gpu-02 resumed" in answer.text
    assert slurmctld.calls == [("scontrol", "--oneliner", "show", "node", "gpu-02"), RESUME]
    with site.session() as session:
        assert control.drains_in_force(session) == []
        (resumed,) = session.scalars(select(NodeEvent).where(NodeEvent.kind == "resume"))
        assert (resumed.reason, resumed.actor_name) == ("resumed by daemon: fixed", ADMIN)
    again = client.post("/nodes/gpu-02/resume", data=form, headers=site.headers(ADMIN))
    assert again.status_code == 200
    assert "gpu-02 resumed" in again.text  # the first answer, replayed
    assert slurmctld.calls.count(RESUME) == 1


def test_resume_needs_a_drain_in_force_and_the_forms_token(
    site: Site, slurmctld: Slurmctld
) -> None:
    client = site.client()
    form = _form_of(client.get("/nodes", headers=site.headers(ADMIN)), "gpu-02")
    not_drained = client.post(
        "/nodes/gpu-04/resume",
        data=form,
        headers={**site.headers(ADMIN), "accept": "application/json"},
    )
    assert not_drained.status_code == 403
    assert not_drained.json() == {
        "error": "the record holds no slurm-medic drain of gpu-04 in force"
    }
    forged = {**form, "csrf": "0" * 64, "idempotency_key": "forged-key-0123456789"}
    refused = client.post("/nodes/gpu-02/resume", data=forged, headers=site.headers(ADMIN))
    assert refused.status_code == 403
    assert slurmctld.calls == []
