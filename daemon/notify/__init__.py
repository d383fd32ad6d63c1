"""Notifications: mail through the site's relay and a Slack/Mattermost-compatible webhook.

`settings` (the `[notify]` section), `messages` (what to say, pure), `outbox` (what happened,
from the record, as `Notification` rows sent once), `sender` (the thread that sends, retries
and rate-limits), `notifier` (the daemon's handle on all of it).
"""
