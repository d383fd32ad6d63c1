"""The daemon's handle on notifications: the cycle's `notify` step enqueues (the record only,
never the network), the sender thread sends."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from daemon.notify.outbox import AddressBook, Enqueued, address_book, enqueue
from daemon.notify.sender import Deliver, Sender, SenderThread, SendResult, transports
from daemon.notify.settings import NotifySettings
from daemon.store.models import NotificationChannel


class Notifier:
    """Built at start-up: a mail map or webhook file that cannot be used stops the daemon
    there (`NotifyConfigError`), not at the first message."""

    def __init__(
        self,
        settings: NotifySettings,
        sessions: sessionmaker[Session],
        clock: Callable[[], datetime],
        *,
        senders: dict[NotificationChannel, Deliver] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.book: AddressBook = address_book(settings)
        self.sender = Sender(
            settings, sessions, clock, transports(settings) if senders is None else senders
        )
        self.thread = SenderThread(self.sender, settings.send_interval_s)

    def enqueue(self, session: Session) -> Enqueued:
        """The cycle's step: add the rows for what happened since the cursor."""
        return enqueue(session, settings=self.settings, book=self.book, now=self.clock())

    def send_due(self) -> list[SendResult]:
        return self.sender.send_due()
