"""The web page: history and approvals for people, over a unix socket or behind a proxy.

Only `settings` is imported by the config; the app (Starlette, Jinja2) loads with
`slurm-medic web`.
"""
