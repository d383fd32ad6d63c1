"""Who the web app believes: the kernel on its unix socket (a real uvicorn server, a real
socket), the trusted proxy with its secret over TCP, nobody else; and the settings and the
secret file that decide it."""

from __future__ import annotations

import os
import pwd
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from click.testing import CliRunner
from starlette.websockets import WebSocketDisconnect

from daemon.cli import main
from daemon.commands.context import CommandContext
from daemon.config import ConfigError, load_settings
from daemon.web.app import create_app
from daemon.web.identity import (
    PeerCredentialsProtocol,
    SecretFileError,
    Unidentified,
    person_named,
    read_proxy_secret,
)
from daemon.web.settings import WebSettings
from tests.web_support import OWNER, PROXY, STRANGER, WebRecord, web_record_at, write_secret

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

_WHO = re.compile(r'<span class="who">(?P<name>[^<( ]+)')


@pytest.fixture
def web_record(tmp_path: Path) -> Iterator[WebRecord]:
    with web_record_at(tmp_path) as record:
        yield record


def _who(page: str) -> str | None:
    """The name a page shows in its header (the person it was rendered for)."""
    shown = _WHO.search(page)
    return None if shown is None else shown["name"]


def test_the_proxys_user_is_believed_with_the_secret_from_its_address(
    web_record: WebRecord,
) -> None:
    with web_record.client(client=PROXY) as client:
        answer = client.get("/", headers=web_record.headers(OWNER))
    assert answer.status_code == 200
    assert _who(answer.text) == OWNER


@pytest.mark.parametrize(
    ("address", "headers"),
    [
        (PROXY, {}),
        (PROXY, {"X-Forwarded-User": OWNER}),
        (PROXY, {"X-Forwarded-User": OWNER, "X-Slurm-Medic-Proxy-Secret": "not the secret"}),
        (PROXY, {"X-Forwarded-User": OWNER, "X-Slurm-Medic-Proxy-Secret": ""}),
        (STRANGER, "right secret"),
        (("testclient", 50000), "right secret"),
        (PROXY, {"X-Forwarded-User": "no-such-user-here", "secret": "right"}),
        (PROXY, {"X-Forwarded-User": "alice\nroot", "secret": "right"}),
        (PROXY, {"X-Forwarded-User": "", "secret": "right"}),
    ],
    ids=[
        "no-headers",
        "no-secret",
        "wrong-secret",
        "empty-secret",
        "untrusted-address",
        "not-an-address",
        "unknown-user",
        "not-a-name",
        "no-user",
    ],
)
def test_anything_but_a_trusted_proxy_naming_a_real_user_is_401(
    web_record: WebRecord, address: tuple[str, int], headers: dict[str, str] | str
) -> None:
    if headers == "right secret":
        headers = web_record.headers(OWNER)
    elif isinstance(headers, dict) and "secret" in headers:
        headers = {**headers, "X-Slurm-Medic-Proxy-Secret": web_record.secret}
        del headers["secret"]
    assert isinstance(headers, dict)
    with web_record.client(client=address) as client:
        page = client.get("/", headers=headers)
        api = client.get("/api/status", headers=headers)
    assert page.status_code == 401
    assert "who are you?" in page.text
    assert api.status_code == 401
    assert "error" in api.json()


def test_a_proxied_root_has_no_roots_authority() -> None:
    person = person_named("root")
    assert (person.name, person.uid, person.is_root) == ("root", 0, False)


def test_a_name_that_is_not_a_user_name_is_refused_before_the_user_database() -> None:
    with pytest.raises(Unidentified, match="not a user name"):
        person_named("../../etc/passwd")


def test_the_user_header_is_configurable(tmp_path: Path) -> None:
    with web_record_at(tmp_path) as record:
        config = record.config.read_text().replace(
            "[web]\n", '[web]\nuser_header = "X-Remote-User"\n'
        )
        record.config.write_text(config)
        with record.client() as client:
            wrong = client.get("/", headers=record.headers(OWNER))
            right = client.get(
                "/",
                headers={"X-Remote-User": OWNER, "X-Slurm-Medic-Proxy-Secret": record.secret},
            )
    assert wrong.status_code == 401
    assert _who(right.text) == OWNER


# ---------------------------------------------------------------- the unix socket


@pytest.fixture
def socket_server(web_record: WebRecord, tmp_path: Path) -> Iterator[Path]:
    """`slurm-medic web --socket`'s server (uvicorn, the peer-credentials protocol) in a
    thread, on a real unix socket."""
    path = tmp_path / "web.sock"
    settings = load_settings(web_record.config)
    app = create_app(CommandContext(settings), proxy_secret=None)
    config = uvicorn.Config(
        app,
        uds=str(path),
        http=PeerCredentialsProtocol,
        proxy_headers=False,
        lifespan="off",
        log_config=None,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start on the socket"
    yield path
    server.should_exit = True
    thread.join(timeout=20)


def test_on_the_socket_the_kernel_names_the_peer_and_headers_do_not(
    socket_server: Path, web_record: WebRecord
) -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    transport = httpx.HTTPTransport(uds=str(socket_server))
    with httpx.Client(transport=transport, base_url="http://slurm-medic") as client:
        # A claim in the proxy's headers counts for nothing on the socket.
        page = client.get("/", headers=web_record.headers("nobody"))
        status = client.get("/api/status")
    assert page.status_code == 200
    assert _who(page.text) == me
    assert ("(root)" in page.text) == (os.getuid() == 0)
    assert status.status_code == 200
    assert page.headers["x-frame-options"] == "DENY"


# ---------------------------------------------------------------- settings and the secret


def test_the_secret_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    write_secret(secret)
    assert len(read_proxy_secret(secret)) == 48
    secret.chmod(0o640)
    with pytest.raises(SecretFileError, match="readable or writable by others"):
        read_proxy_secret(secret)
    secret.write_text("short\n")
    secret.chmod(0o600)
    with pytest.raises(SecretFileError, match="fewer than 16 bytes"):
        read_proxy_secret(secret)
    with pytest.raises(SecretFileError, match="No such file"):
        read_proxy_secret(tmp_path / "absent")


@pytest.mark.parametrize(
    ("section", "option"),
    [
        ('trusted_proxies = ["10.0.0.0/8"]', "web.trusted_proxies needs web.proxy_secret_file"),
        ('trusted_proxies = ["10.0.0.300/8"]', "web.trusted_proxies"),
        ('listen = "localhost"', "web.listen"),
        ('listen = "localhost:99999"', "web.listen"),
        ('user_header = "X-User: root"', "web.user_header"),
        ('proxy_secret_file = "relative/secret"', "web.proxy_secret_file"),
        ("colour = true", "web.colour"),
    ],
)
def test_a_bad_web_option_is_refused_by_name(tmp_path: Path, section: str, option: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"[web]\n{section}\n")
    with pytest.raises(ConfigError, match=option):
        load_settings(config)


def test_the_web_settings_parse_networks_and_the_default_address() -> None:
    web = WebSettings.model_validate(
        {"trusted_proxies": ["10.9.8.0/24", "::1"], "proxy_secret_file": "/etc/secret"}
    )
    assert [str(network) for network in web.trusted_proxies] == ["10.9.8.0/24", "::1/128"]
    assert web.listen == "127.0.0.1:8765"
    assert web.socket is None
    assert not web.everyone_sees_all


# ---------------------------------------------------------------- the command


def test_the_command_takes_listen_or_socket_not_both(web_record: WebRecord) -> None:
    result = CliRunner().invoke(
        main,
        ["web", "--config", str(web_record.config), "--listen", "127.0.0.1:1", "--socket", "/x"],
    )
    assert result.exit_code == 2
    assert "give --listen or --socket, not both" in result.output


def test_the_command_refuses_a_secret_file_others_can_read(web_record: WebRecord) -> None:
    secret = Path(load_settings(web_record.config).web.proxy_secret_file or "")
    secret.chmod(0o644)
    result = CliRunner().invoke(main, ["web", "--config", str(web_record.config)])
    assert result.exit_code == 2
    assert "slurm-medic web: web.proxy_secret_file" in result.output
    assert "readable or writable by others" in result.output


def test_the_command_refuses_a_missing_record_before_serving(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{tmp_path}/absent.db"\n')
    result = CliRunner().invoke(main, ["web", "--config", str(config), "--listen", "127.0.0.1:1"])
    assert result.exit_code == 4
    assert result.output.startswith("slurm-medic web: ")


def test_the_command_refuses_a_bad_listen_address_by_name(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["web", "--listen", "nowhere"], env={"SLURM_MEDIC_CONFIG": ""}
    )
    assert result.exit_code == 2
    assert "web.listen" in result.output


def test_a_websocket_is_closed_whoever_asks(web_record: WebRecord) -> None:
    with (
        web_record.client() as client,
        pytest.raises(WebSocketDisconnect) as closed,
        client.websocket_connect("/", headers=web_record.headers(OWNER)),
    ):
        pass
    assert closed.value.code == 1008
