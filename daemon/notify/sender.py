"""Sending the outbox's rows, away from the daemon's cycle: a thread with its own sessions.

Each row is claimed before it is sent (its attempt counted and its next try pushed past the
send's timeouts, in one conditional UPDATE), so two senders never send one row together and a
sender killed mid-send leaves the row to be retried. A row that fails waits `backoff_s`,
doubling up to `max_backoff_s`, and is `given_up` after `max_attempts`. No session is held
while the network is used.

The rate limit holds rows back (they wait until the recipient's hour has room) rather than
dropping them: each message asks for something (an approval, a look at a run or a node) and is
recorded once, so a late message beats a lost one. A row held back for an approval that was
decided meanwhile is `suppressed`: nothing waits any more.
"""

from __future__ import annotations

import json
import logging
import os
import smtplib
import ssl
import stat
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.message import EmailMessage
from email.utils import format_datetime, make_msgid
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from daemon.notify.outbox import NotifyConfigError
from daemon.notify.settings import NotifySettings
from daemon.store.models import (
    Notification,
    NotificationChannel,
    NotificationEvent,
    NotificationState,
    Proposal,
)
from daemon.store.states import ProposalState

log = logging.getLogger(__name__)

HOUR = timedelta(hours=1)
MAX_WEBHOOK_URL_BYTES = 4096
MAX_ERROR_CHARS = 2000
# Rows looked at per pass: a backlog is sent over several passes, each short.
BATCH = 100
# A claimed row is tried again this long after its send's own timeouts, if its sender died.
CLAIM_MARGIN_S = 60.0


class DeliveryError(Exception):
    """A message the relay or the receiver did not take."""


# Sends one row on its channel, or raises (DeliveryError for the channel's own failures).
Deliver = Callable[[Notification], None]


# ----------------------------------------------------------------------------- transports


@dataclass(frozen=True)
class SmtpRelay:
    """Mail through the site's relay: one connection per message, with a timeout."""

    host: str
    port: int
    sender: str
    starttls: bool
    timeout_s: float

    def __call__(self, row: Notification) -> None:
        message = EmailMessage()
        message["From"] = self.sender
        message["To"] = row.recipient
        message["Subject"] = row.title
        message["Date"] = format_datetime(row.created_at)
        message["Message-ID"] = make_msgid("slurm-medic", domain=self.sender.rpartition("@")[2])
        message["Auto-Submitted"] = "auto-generated"
        message.set_content(row.body)
        try:
            with smtplib.SMTP(self.host, self.port, timeout=self.timeout_s) as smtp:
                if self.starttls:
                    smtp.starttls(context=ssl.create_default_context())
                smtp.send_message(message)
        except (OSError, smtplib.SMTPException) as error:
            raise DeliveryError(f"{type(error).__name__}: {error}") from error


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would move the message (and the URL's token) somewhere not configured."""

    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None


@dataclass(frozen=True)
class WebhookPost:
    """A Slack/Mattermost-compatible incoming webhook: `{"text": ...}` as JSON."""

    url: str
    timeout_s: float

    def __call__(self, row: Notification) -> None:
        # S310: the scheme is http(s), checked when the URL was read (`read_webhook_url`).
        request = urllib.request.Request(  # noqa: S310
            self.url,
            data=json.dumps({"text": row.body}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        opener = urllib.request.build_opener(_NoRedirects)
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                response.read(64 * 1024)
        except (OSError, ValueError) as error:  # URLError, HTTPError; InvalidURL
            # The URL is a secret: never in the record's last_error or the log.
            raise DeliveryError(str(error).replace(self.url, "<webhook>")) from error


def read_webhook_url(path: Path) -> str:
    """The webhook's URL from its file, refused if others may read it (it is a secret)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise NotifyConfigError(f"webhook_url_file {path}: {error.strerror}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotifyConfigError(f"webhook_url_file {path} is not a regular file")
        if info.st_mode & stat.S_IRWXO:
            raise NotifyConfigError(
                f"webhook_url_file {path} has mode {stat.S_IMODE(info.st_mode):04o}: others may"
                " read the webhook's secret; chmod o-rwx it"
            )
        raw = os.read(fd, MAX_WEBHOOK_URL_BYTES + 1)
    finally:
        os.close(fd)
    url = raw.decode("utf-8", "replace").strip()
    if len(raw) > MAX_WEBHOOK_URL_BYTES or not url.startswith(("https://", "http://")):
        raise NotifyConfigError(f"webhook_url_file {path} does not hold one http(s) URL")
    if any(c.isspace() for c in url):
        raise NotifyConfigError(f"webhook_url_file {path} does not hold one http(s) URL")
    return url


def transports(settings: NotifySettings) -> dict[NotificationChannel, Deliver]:
    """The configured channels' senders (the webhook's file is read here, at start-up)."""
    senders: dict[NotificationChannel, Deliver] = {}
    if settings.smtp_host is not None:
        senders[NotificationChannel.MAIL] = SmtpRelay(
            settings.smtp_host,
            settings.smtp_port,
            settings.smtp_from,
            settings.smtp_starttls,
            settings.smtp_timeout_s,
        )
    if settings.webhook_url_file is not None:
        senders[NotificationChannel.WEBHOOK] = WebhookPost(
            read_webhook_url(settings.webhook_url_file), settings.webhook_timeout_s
        )
    return senders


# ----------------------------------------------------------------------------- sending


def backoff(attempts: int, settings: NotifySettings) -> timedelta:
    """The wait after the `attempts`-th failure: backoff_s, doubling, capped."""
    seconds = settings.backoff_s * 2 ** min(attempts - 1, 30)
    return timedelta(seconds=min(seconds, settings.max_backoff_s))


@dataclass(frozen=True)
class SendResult:
    row_id: int
    state: NotificationState | None  # None: left pending (held back, failed, or taken)
    detail: str = ""


class Sender:
    """One pass over the due rows (`send_due`); the thread calls it, tests too."""

    def __init__(
        self,
        settings: NotifySettings,
        sessions: sessionmaker[Session],
        clock: Callable[[], datetime],
        senders: dict[NotificationChannel, Deliver],
        stopping: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.clock = clock
        self.senders = senders
        self.stopping = stopping or threading.Event()

    def send_due(self) -> list[SendResult]:
        now = self.clock()
        with self.sessions() as session:
            due = list(
                session.scalars(
                    select(Notification.id)
                    .where(
                        Notification.state == NotificationState.PENDING.value,
                        (Notification.next_attempt_at.is_(None))
                        | (Notification.next_attempt_at <= now),
                        # A channel configured no more leaves its rows waiting, out of the way.
                        Notification.channel.in_([channel.value for channel in self.senders]),
                    )
                    .order_by(Notification.id)
                    .limit(BATCH)
                )
            )
            session.commit()
        results: list[SendResult] = []
        for row_id in due:
            if self.stopping.is_set():
                break
            results.append(self._send_one(row_id))
        return results

    def _send_one(self, row_id: int) -> SendResult:
        now = self.clock()
        with self.sessions() as session:
            row = session.get(Notification, row_id)
            if row is None or row.state != NotificationState.PENDING.value:
                return SendResult(row_id, None, "no longer pending")
            if row.next_attempt_at is not None and row.next_attempt_at > now:
                return SendResult(row_id, None, "claimed by another sender meanwhile")
            moot = _moot(session, row)
            if moot:
                row.state = NotificationState.SUPPRESSED.value
                row.last_error = moot
                session.commit()
                return SendResult(row_id, NotificationState.SUPPRESSED, moot)
            room_at = self._room_at(session, row, now)
            if room_at is not None:
                row.next_attempt_at = room_at
                session.commit()
                return SendResult(row_id, None, f"rate limit: held until {room_at.isoformat()}")
            deliver = self.senders[NotificationChannel(row.channel)]
            if not self._claim(session, row, now):
                return SendResult(row_id, None, "taken by another sender")
            session.commit()
        try:
            deliver(row)
        except DeliveryError as error:
            return self._failed(row_id, str(error))
        except Exception as error:  # a message that cannot even be built is retried, then given up
            log.exception("notification %s could not be sent", row_id)
            return self._failed(row_id, f"{type(error).__name__}: {error}")
        with self.sessions() as session:
            session.execute(
                update(Notification)
                .where(Notification.id == row_id)
                .values(state=NotificationState.SENT.value, sent_at=self.clock())
            )
            session.commit()
        log.info(
            "notification sent",
            extra={"fields": {"id": row_id, "channel": row.channel, "event": row.event}},
        )
        return SendResult(row_id, NotificationState.SENT)

    def _claim(self, session: Session, row: Notification, now: datetime) -> bool:
        """Count the attempt and push the next try past this send, if no one else did first."""
        lease = timedelta(seconds=self._timeout_s(row) + CLAIM_MARGIN_S)
        claimed = session.execute(
            update(Notification)
            .where(
                Notification.id == row.id,
                Notification.state == NotificationState.PENDING.value,
                Notification.attempts == row.attempts,
                (Notification.next_attempt_at.is_(None)) | (Notification.next_attempt_at <= now),
            )
            .values(attempts=row.attempts + 1, next_attempt_at=now + lease)
            .execution_options(synchronize_session=False)
        )
        return bool(claimed.rowcount)  # type: ignore[attr-defined]

    def _timeout_s(self, row: Notification) -> float:
        if row.channel == NotificationChannel.MAIL.value:
            return self.settings.smtp_timeout_s
        return self.settings.webhook_timeout_s

    def _room_at(self, session: Session, row: Notification, now: datetime) -> datetime | None:
        """None if the recipient's last hour has room on this channel, else when it will."""
        window = session.scalars(
            select(Notification.sent_at)
            .where(
                Notification.recipient == row.recipient,
                Notification.channel == row.channel,
                Notification.state == NotificationState.SENT.value,
                Notification.sent_at > now - HOUR,
            )
            .order_by(Notification.sent_at.desc())
            .limit(self.settings.max_per_recipient_per_hour)
        ).all()
        if len(window) < self.settings.max_per_recipient_per_hour:
            return None
        oldest = min(sent for sent in window if sent is not None)
        return oldest + HOUR

    def _failed(self, row_id: int, error: str) -> SendResult:
        now = self.clock()
        with self.sessions() as session:
            row = session.get(Notification, row_id)
            if row is None:
                return SendResult(row_id, None, error)
            row.last_error = error[:MAX_ERROR_CHARS]
            if row.attempts >= self.settings.max_attempts:
                row.state = NotificationState.GIVEN_UP.value
                session.commit()
                log.warning(
                    "notification given up",
                    extra={
                        "fields": {
                            "id": row_id,
                            "channel": row.channel,
                            "event": row.event,
                            "attempts": row.attempts,
                            "error": row.last_error,
                        }
                    },
                )
                return SendResult(row_id, NotificationState.GIVEN_UP, error)
            row.next_attempt_at = now + backoff(row.attempts, self.settings)
            session.commit()
        log.info("notification failed; retried later", extra={"fields": {"id": row_id}})
        return SendResult(row_id, None, error)


def _moot(session: Session, row: Notification) -> str:
    """Why a row no longer needs sending ("" if it does): an approval decided meanwhile."""
    if row.event != NotificationEvent.APPROVAL_WAITING.value:
        return ""
    kind, _, number = row.subject.partition(":")
    proposal = session.get(Proposal, int(number)) if kind == "proposal" else None
    if proposal is None or proposal.state == ProposalState.PROPOSED.value:
        return ""
    return f"proposal {proposal.id} is {proposal.state} now: nothing waits"


# ----------------------------------------------------------------------------- the thread


class SenderThread:
    """Runs `send_due` every `send_interval_s`, or at once when woken; stops when told."""

    def __init__(self, sender: Sender, interval_s: float) -> None:
        self.sender = sender
        self.interval_s = interval_s
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # A daemon thread: a send stuck past its timeouts never keeps the process alive.
        self._thread = threading.Thread(target=self._run, name="slurm-medic-notify", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float | None = None) -> None:
        """Let a send in flight finish (its own timeouts bound the wait): a row sent but not
        marked would be sent again by the next daemon."""
        if timeout_s is None:
            settings = self.sender.settings
            timeout_s = max(settings.smtp_timeout_s, settings.webhook_timeout_s) + 1.0
        self.sender.stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self.sender.stopping.is_set():
            try:
                self.sender.send_due()
            except Exception:  # the sender thread must survive a bad pass (a record down)
                log.exception("notification pass failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()
