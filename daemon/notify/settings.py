"""The `[notify]` section: where mail and webhook messages go, how often they are retried and
how many one recipient gets in an hour. Without the section nothing is notified."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from daemon.store.models import NotificationEvent

# A plain address (local@domain): no display name, no comment, nothing a header could carry
# beyond the address. Stricter than RFC 5322 on purpose.
ADDRESS_PATTERN = r"\A[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*\Z"
ADDRESS = re.compile(ADDRESS_PATTERN)
Address = Annotated[str, StringConstraints(pattern=ADDRESS_PATTERN, max_length=254)]
Domain = Annotated[
    str, StringConstraints(pattern=r"\A[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*\Z", max_length=253)
]
HostName = Annotated[str, StringConstraints(pattern=r"\A[A-Za-z0-9.:\[\]-]{1,253}\Z")]
WebUrl = Annotated[str, StringConstraints(pattern=r"\Ahttps?://[^\s<>\"'`]{1,2000}\Z")]


class NotifySettings(BaseModel):
    """Mail through the site's relay (`smtp_host`) and/or one webhook (`webhook_url_file`).

    A job's mail goes to its owner as `mail_map` names them (`user: address` lines), else
    `user@mail_domain`; node drains go to `admin_mail`. Each message is recorded before it is
    sent and retried `max_attempts` times, `backoff_s` doubling up to `max_backoff_s`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", regex_engine="python-re")

    events: tuple[NotificationEvent, ...] = tuple(NotificationEvent)
    smtp_host: HostName | None = None
    smtp_port: int = Field(default=25, ge=1, le=65535)
    smtp_from: Address = "slurm-medic@localhost"
    smtp_starttls: bool = False
    smtp_timeout_s: float = Field(default=10.0, gt=0, le=120)
    mail_domain: Domain | None = None
    mail_map: Path | None = None
    admin_mail: tuple[Address, ...] = ()
    # The URL carries the webhook's secret token: it lives in a file others cannot read.
    webhook_url_file: Path | None = None
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=120)
    # The web page's base URL, for the links in messages (none without it).
    web_url: WebUrl | None = None
    max_attempts: int = Field(default=8, ge=1, le=100)
    backoff_s: float = Field(default=60.0, gt=0, le=86400)
    max_backoff_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    max_per_recipient_per_hour: int = Field(default=20, ge=1, le=10_000)
    # How often the sender looks for due messages when nothing wakes it.
    send_interval_s: float = Field(default=10.0, gt=0, le=3600)
    # Events are found in the record since the `notify` cursor, re-read `overlap_s` back (the
    # unique dedupe makes a second look harmless); on a first start, `initial_lookback_s` back.
    overlap_s: float = Field(default=600.0, ge=0, le=86400)
    initial_lookback_s: float = Field(default=3600.0, ge=0, le=30 * 86400)

    @model_validator(mode="after")
    def _someone_to_tell(self) -> NotifySettings:
        """A section that could deliver nothing would look configured and stay silent."""
        if self.smtp_host is None and self.webhook_url_file is None:
            raise ValueError("needs smtp_host (mail) or webhook_url_file (webhook), or both")
        if self.smtp_host is not None and not (
            self.mail_domain or self.mail_map or self.admin_mail
        ):
            raise ValueError("smtp_host needs mail_domain, mail_map or admin_mail to address mail")
        for name in ("mail_map", "webhook_url_file"):
            path = getattr(self, name)
            if path is not None and not path.is_absolute():
                raise ValueError(f"{name} must be an absolute path")
        return self

    @property
    def mail(self) -> bool:
        return self.smtp_host is not None

    @property
    def webhook(self) -> bool:
        return self.webhook_url_file is not None
