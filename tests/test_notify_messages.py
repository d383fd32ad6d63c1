"""What a person is told, from record facts alone: the words, the commands and links, and that
what a user wrote (a job name, a reason quoting a log) can neither add a mail header nor become
chat markup; the addresses, the `[notify]` settings and the retries' backoff."""

from __future__ import annotations

import re
from datetime import timedelta
from email import message_from_string, policy
from email.message import EmailMessage
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from daemon.config import Settings
from daemon.notify.messages import (
    JobFacts,
    NodeDrained,
    RunEscalated,
    RunGivenUp,
    WaitingApproval,
    mail_body,
    mail_subject,
    message_for,
    one_line,
    webhook_text,
    webhook_value,
)
from daemon.notify.outbox import (
    WEBHOOK_RECIPIENT,
    AddressBook,
    NotifyConfigError,
    address_book,
    addressed,
    parse_mail_map,
)
from daemon.notify.sender import backoff
from daemon.notify.settings import NotifySettings
from daemon.store.models import NotificationChannel, NotificationEvent

HOSTILE = (
    "x\r\nBcc: everyone@example.org\r\n\r\n*bold* [click](http://evil.example) <!channel>"
    " @here `code` <http://evil.example|ok> &amp; \u202eevil\u2028# head"
)
JOB = JobFacts(slurm_job_id=4242, name="llama-7b", user="alice", kind="true_oom", lineage_id=7)
WAITING = WaitingApproval(
    proposal_id=31,
    job=JOB,
    remediator="micro_batch_down",
    rung=1,
    rationale="micro-batch 8 -> 4, grad-accum 4 -> 8: the global batch is kept",
    changes_science=False,
)
WEB = "https://medic.example.org/"


def _mail_settings(**extra: object) -> NotifySettings:
    return NotifySettings.model_validate(
        {"smtp_host": "127.0.0.1", "mail_domain": "example.org", **extra}
    )


def test_a_waiting_approval_names_the_job_the_fix_and_the_commands() -> None:
    message = message_for(WAITING, web_url=WEB)
    subject, body = mail_subject(message), mail_body(message)
    assert subject == "[slurm-medic] job 4242 (llama-7b): relaunch 31 waits for your approval"
    assert "Job 4242 llama-7b of alice died: true_oom" in body
    assert "Proposed fix: micro_batch_down (rung 1)" in body
    assert "slurm-medic approve 31 --comment" in body
    assert "slurm-medic reject 31 --why" in body
    assert "On the web: https://medic.example.org/approvals" in body
    assert message.owner == "alice"
    assert message.subject == "proposal:31"


def test_no_web_url_no_link() -> None:
    assert "On the web" not in mail_body(message_for(WAITING, web_url=None))


def test_a_fix_that_changes_the_science_says_so() -> None:
    science = WaitingApproval(31, JOB, "seq_len_down", 3, "shorter sequences", True)
    assert "it changes the science of the run" in mail_body(message_for(science, web_url=None))


def test_a_run_given_up_goes_to_its_owner_with_its_story() -> None:
    fact = RunGivenUp(7, "llama-7b", "bob", "exhausted", "a person must decide: no rung", JOB)
    message = message_for(fact, web_url=WEB)
    body = mail_body(message)
    assert message.owner == "bob"
    assert message.subject == "lineage:7"
    assert mail_subject(message) == "[slurm-medic] run L7 (llama-7b) exhausted"
    assert "Why: a person must decide: no rung" in body
    assert "slurm-medic show L7" in body
    assert "https://medic.example.org/runs/7" in body


@pytest.mark.parametrize(
    ("outcome", "words"),
    [
        ("same_failure", "tries the next fix of the ladder"),
        ("different_failure", "a person must decide"),
    ],
)
def test_an_escalation_says_how_far_the_relaunch_got_and_what_comes_next(
    outcome: str, words: str
) -> None:
    fact = RunEscalated(31, JOB, 4300, "true_oom", outcome, 120, 64, "relaunch failed again")
    message = message_for(fact, web_url=None)
    body = mail_body(message)
    assert message.event is NotificationEvent.RUN_ESCALATED
    assert mail_subject(message).endswith("relaunch 4300 did not pass step 120")
    assert "reached step 64; it had to pass step 120" in body
    assert "The relaunch 4300 died: true_oom" in body
    assert words in body


def test_a_drain_goes_to_the_admins_with_the_resume_command() -> None:
    fact = NodeDrained(9, "gpu-07", "medic: incident 3 (hardware) job 4242", None, 4242)
    message = message_for(fact, web_url=WEB)
    body = mail_body(message)
    assert message.owner is None
    assert message.subject == "node_event:9"
    assert "slurm-medic nodes resume gpu-07" in body
    assert "After job 4242 died on it." in body
    assert "https://medic.example.org/nodes/gpu-07" in body


@pytest.mark.parametrize("node", ["gpu-07/../../admin", "..", "", "gpu\u00e907", "gpu 07"])
def test_a_node_name_that_is_not_plain_gets_no_link(node: str) -> None:
    fact = NodeDrained(9, node, "medic: sweep", "xid_hardware", None)
    assert "On the web" not in mail_body(message_for(fact, web_url=WEB))


def _hostile_facts() -> list[WaitingApproval | RunGivenUp | RunEscalated | NodeDrained]:
    job = JobFacts(1, HOSTILE, HOSTILE, HOSTILE, 2)
    return [
        WaitingApproval(3, job, HOSTILE, 0, HOSTILE, False),
        RunGivenUp(2, HOSTILE, "alice", "exhausted", HOSTILE, job),
        RunEscalated(3, job, 5, HOSTILE, "same_failure", 1, 0, HOSTILE),
        NodeDrained(4, HOSTILE, HOSTILE, HOSTILE, 1),
    ]


@pytest.mark.parametrize("fact", _hostile_facts(), ids=lambda fact: type(fact).__name__)
def test_a_hostile_name_cannot_add_a_mail_header(fact: object) -> None:
    message = message_for(fact, web_url=WEB)  # type: ignore[arg-type]
    mail = EmailMessage()
    mail["To"] = "alice@example.org"
    mail["Subject"] = mail_subject(message)  # the header refuses CR/LF: it must not see one
    mail.set_content(mail_body(message))
    parsed = message_from_string(mail.as_string(), policy=policy.default)
    assert parsed["Bcc"] is None
    assert parsed.get_all("To") == ["alice@example.org"]
    assert "\r" not in mail_body(message)
    assert all(len(line) < 1500 for line in mail_body(message).splitlines())  # values cut


@pytest.mark.parametrize("fact", _hostile_facts(), ids=lambda fact: type(fact).__name__)
def test_a_hostile_name_cannot_become_chat_markup(fact: object) -> None:
    text = webhook_text(message_for(fact, web_url=WEB))  # type: ignore[arg-type]
    assert "<" not in text
    assert ">" not in text
    assert "&amp;" not in text  # no entity that Slack would decode
    assert "@here" not in text  # a zero-width space splits every mention
    assert "\u202e" not in text
    assert "\u2028" not in text
    # Every piece of the hostile text sits inside a code span: outside the spans, only our words.
    outside = re.sub(r"`[^`\n]*`", "", text)
    assert "click" not in outside
    assert "bold" not in outside
    assert "head" not in outside
    assert "[" not in outside


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_any_text_is_one_line_and_one_code_span(text: str) -> None:
    line = one_line(text)
    assert "\n" not in line
    assert "\r" not in line
    assert len(line) <= 300
    value = webhook_value(text)
    assert value == "(empty)" or (
        value.startswith("`") and value.endswith("`") and value.count("`") == 2
    )
    assert "<" not in value
    assert ">" not in value
    assert "&" not in value


def test_one_line_keeps_what_is_shown() -> None:
    assert one_line("llama 7b \u00e9t\u00e9 \u4e2d\u6587") == "llama 7b \u00e9t\u00e9 \u4e2d\u6587"
    assert one_line("a\r\nb\tc\x00d") == "a b c d"


# ----------------------------------------------------------------------------- addresses


def test_the_mail_map_wins_over_the_domain() -> None:
    book = AddressBook("example.org", {"alice": "alice.smith@lab.example.org"}, ("ops@x.org",))
    assert book.mail_to("alice") == ("alice.smith@lab.example.org",)
    assert book.mail_to("bob") == ("bob@example.org",)
    assert book.mail_to(None) == ("ops@x.org",)


def test_a_user_name_that_is_no_address_gets_no_mail() -> None:
    assert AddressBook("example.org").mail_to("bob smith") == ()
    assert AddressBook(None, {}).mail_to("alice") == ()


def test_the_mail_map_reads_aliases_lines(tmp_path: Path) -> None:
    path = tmp_path / "mail_map"
    path.write_text("# site map\nalice: a.smith@example.org\n\nbob :bob@lab.example.org # x\n")
    book = address_book(_mail_settings(mail_map=str(path)))
    assert book.mapped == {"alice": "a.smith@example.org", "bob": "bob@lab.example.org"}


@pytest.mark.parametrize(
    "line",
    ["alice a@example.org", "alice: a@example.org, eve@example.org", "alice: <a@example.org>"],
)
def test_a_mail_map_line_that_is_not_user_address_is_refused(line: str) -> None:
    with pytest.raises(NotifyConfigError, match="map:1: not `user: address`"):
        parse_mail_map(line, source="map")


def test_a_missing_mail_map_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(NotifyConfigError, match="No such file"):
        address_book(_mail_settings(mail_map=str(tmp_path / "absent")))


def test_each_message_is_one_row_per_channel_and_recipient(tmp_path: Path) -> None:
    url_file = tmp_path / "hook"
    url_file.write_text("https://chat.example.org/hooks/x\n")
    notify = _mail_settings(webhook_url_file=str(url_file), admin_mail=["a@x.org", "b@x.org"])
    book = address_book(notify)
    drained = message_for(NodeDrained(9, "gpu-07", "medic: x", None, None), web_url=None)
    rows = addressed(drained, settings=notify, book=book)
    assert [(row.channel, row.recipient) for row in rows] == [
        (NotificationChannel.MAIL, "a@x.org"),
        (NotificationChannel.MAIL, "b@x.org"),
        (NotificationChannel.WEBHOOK, WEBHOOK_RECIPIENT),
    ]
    assert len({row.dedupe for row in rows}) == 3
    assert all("https://chat" not in row.dedupe for row in rows)  # the URL is a secret


# ----------------------------------------------------------------------------- settings


def test_no_section_no_notifications() -> None:
    assert Settings().notify is None


def test_the_section_in_the_settings() -> None:
    loaded = Settings.model_validate(
        {"notify": {"smtp_host": "relay.example.org", "mail_domain": "example.org"}}
    )
    assert loaded.notify is not None
    assert loaded.notify.mail
    assert not loaded.notify.webhook
    assert set(loaded.notify.events) == set(NotificationEvent)


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({}, "needs smtp_host"),
        ({"smtp_host": "relay"}, "needs mail_domain, mail_map or admin_mail"),
        ({"webhook_url_file": "hook"}, "must be an absolute path"),
        ({"smtp_host": "relay", "mail_domain": "x.org", "smtp_port": 0}, "greater than"),
        ({"smtp_host": "relay", "admin_mail": ["ops@x.org\nBcc: y@z.org"]}, "pattern"),
        ({"smtp_host": "relay", "mail_domain": "x.org", "web_url": "javascript:x"}, "pattern"),
        ({"smtp_host": "relay", "mail_domain": "x.org", "retries": 3}, "Extra inputs"),
    ],
)
def test_a_bad_section_is_refused(section: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        NotifySettings.model_validate(section)


def test_backoff_doubles_up_to_its_cap() -> None:
    notify = _mail_settings(backoff_s=60, max_backoff_s=600)
    waits = [backoff(attempt, notify) for attempt in range(1, 7)]
    assert waits == [timedelta(seconds=s) for s in (60, 120, 240, 480, 600, 600)]
