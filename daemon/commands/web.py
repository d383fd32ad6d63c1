"""`slurm-medic web`: the web page and its JSON API, on a unix socket or a TCP address.

Run by an operator (root or a service user) as `run` is, with the same config rules
(`context.CommandContext`): under sudo only the system config counts. It listens where
`--listen HOST:PORT` or `--socket PATH` says, else where `[web]` says (its socket if it names
one, else its `listen`). Who is asking is the kernel's word on the socket and the trusted
proxy's over TCP (daemon/web/identity.py). How many connections each peer and all may hold,
and how long one may keep the server waiting, is daemon/web/connections.py's.

Exit codes: 0 stopped; 2 a config or a setting that cannot be used (the proxy's secret file
included, and a descriptor limit too low for any connection); 4 the record cannot be used
(missing, unreachable, or at another schema). Each failure is one line, `slurm-medic web: ...`.
"""

from __future__ import annotations

import logging

import click

from daemon.commands.context import CommandContext, config_option, database_option
from daemon.commands.paths import typed_path

EXIT_CONFIG = 2
PREFIX = "slurm-medic web"


@click.command("web")
@config_option
@database_option
@click.option("--listen", metavar="HOST:PORT", default=None, help="Serve over TCP here.")
@click.option(
    "--socket",
    "socket_path",
    metavar="PATH",
    callback=typed_path,
    default=None,
    help="Serve on this unix socket (users are known by their uid).",
)
def web_command(
    config_path: str | None,
    database_url: str | None,
    listen: str | None,
    socket_path: str | None,
) -> None:
    """Serve the web page: history, a run's story, approvals, nodes, and the JSON API."""
    if listen is not None and socket_path is not None:
        raise click.UsageError("give --listen or --socket, not both")
    overrides: dict[str, dict[str, object]] = {}
    if listen is not None:
        overrides["web"] = {"listen": listen, "socket": None}
    if socket_path is not None:
        overrides["web"] = {"socket": socket_path}
    context = CommandContext.load(
        config_path,
        database_url,
        overrides=overrides,
        prefix=PREFIX,
        config_exit=EXIT_CONFIG,
    )
    # The web layers (Starlette, Jinja2, uvicorn) only for this command.
    import uvicorn  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    from daemon.logs import configure_logging  # noqa: PLC0415
    from daemon.metrics.serve import web_metrics_app  # noqa: PLC0415
    from daemon.web.app import create_app  # noqa: PLC0415
    from daemon.web.connections import (  # noqa: PLC0415
        BACKLOG,
        RESERVED_DESCRIPTORS,
        ConnectionGuard,
        GuardedServer,
        guarded_protocol,
        raise_descriptor_limit,
    )
    from daemon.web.identity import SecretFileError, read_proxy_secret  # noqa: PLC0415
    from daemon.web.settings import split_listen  # noqa: PLC0415

    web = context.settings.web
    try:
        secret = None if web.proxy_secret_file is None else read_proxy_secret(web.proxy_secret_file)
    except SecretFileError as error:
        raise context.fail(str(error), exit_code=EXIT_CONFIG) from error
    with context.session(read_only=True):
        pass  # a record that cannot be used ends the command here (exit 4), not page by page
    configure_logging()
    # Connections are capped below the descriptor limit, itself raised as far as it goes.
    descriptors = raise_descriptor_limit()
    guard = ConnectionGuard.for_settings(web, descriptors=descriptors)
    if guard.total < 1:
        raise context.fail(
            f"the descriptor limit ({descriptors}) leaves no room for connections"
            f" ({RESERVED_DESCRIPTORS} are kept for the record and the server): raise LimitNOFILE",
            exit_code=EXIT_CONFIG,
        )
    if guard.total < web.max_connections:
        logging.getLogger("slurm_medic.web").warning(
            "web.max_connections is %d, but the descriptor limit (%d) leaves room for %d",
            web.max_connections,
            descriptors,
            guard.total,
        )
    host, port = split_listen(web.listen)
    config = uvicorn.Config(
        create_app(
            context,
            proxy_secret=secret,
            # The record's numbers for Prometheus, read at each scrape on a read-only session.
            extra_routes=[
                Route("/metrics", web_metrics_app(lambda: context.session(read_only=True)))
            ],
        ),
        host=host,
        port=port,
        uds=None if web.socket is None else str(web.socket),
        # The peer-credentials protocol under the guard (daemon/web/connections.py), on the
        # asyncio loop whose accept errors it quiets; no WebSocket protocol (no page speaks it,
        # and a connection handed to one would leave the guard's count).
        http=guarded_protocol(guard),
        loop="asyncio",
        ws="none",
        backlog=BACKLOG,
        timeout_keep_alive=web.keep_alive_s,
        # uvicorn's own limit (503 to a request) only as a backstop above the guard's cap.
        limit_concurrency=guard.total + 1,
        # Never rewrite the peer address from X-Forwarded-For: identity.py decides whom to
        # believe, and a local client could claim to be the proxy.
        proxy_headers=False,
        server_header=False,
        lifespan="off",
        log_config=None,
    )
    GuardedServer(config, guard).run()
