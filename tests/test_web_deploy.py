"""The web page as deploy/ sets it up, with the real pieces: `slurm-medic web` answering
Prometheus and refusing strangers, the example nginx front (deploy/web/nginx-oidc.conf) run by
a real nginx with a stand-in for oauth2-proxy, and Open OnDemand's forwarder
(deploy/web/ood) run as alice against the server's unix socket.

The nginx example is run as written but for what a test machine lacks: its TLS listener
becomes a loopback port, its upstream ports and its secret include point at this test's.
Each rewrite must find its line, so an example that drifts fails here.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser import (
    LOOPBACK,
    MEDIC,
    SECRET_HEADER,
    USER_HEADER,
    WebServer,
    free_port,
    make_record,
    seed_record,
    web_server,
)

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

REPO = Path(__file__).resolve().parent.parent
NGINX_EXAMPLE = REPO / "deploy" / "web" / "nginx-oidc.conf"
OOD_APP = REPO / "deploy" / "web" / "ood" / "slurm-medic" / "passenger_wsgi.py"
OOD_PREFIX = "/pun/sys/slurm-medic"
START_S = 20


@pytest.fixture(scope="module")
def record_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = make_record(tmp_path_factory.mktemp("web-deploy") / "medic.db")
    seed_record(url)
    return url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, record_url: str) -> Iterator[WebServer]:
    work = tmp_path_factory.mktemp("web-server")
    with web_server(work, f'[store]\nurl = "{record_url}"\n') as running:
        yield running


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        connection.close()


def _port(server: WebServer) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


# ---------------------------------------------------------------- the server itself


def test_metrics_answer_without_identity_and_pages_do_not(server: WebServer) -> None:
    status, text = _get(_port(server), "/metrics")
    assert status == 200
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families, text[:500]
    assert all(name.startswith("slurm_medic_") for name in families)
    # The seeded record: alice's one proposal waits.
    (pending,) = families["slurm_medic_pending_approvals"].samples
    assert pending.value == 1
    (up,) = families["slurm_medic_record_up"].samples
    assert up.value == 1

    assert _get(_port(server), "/")[0] == 401
    # A local user who connects directly cannot claim a name without the proxy's secret.
    assert _get(_port(server), "/", {USER_HEADER: "root"})[0] == 401
    assert _get(_port(server), "/", {USER_HEADER: "alice", SECRET_HEADER: "guess"})[0] == 401
    status, page = _get(_port(server), "/", {USER_HEADER: "alice", SECRET_HEADER: server.secret})
    assert status == 200
    assert '<span class="who">alice</span>' in page


# ---------------------------------------------------------------- nginx with OIDC in front


class _OAuth2ProxyStandIn(BaseHTTPRequestHandler):
    """oauth2-proxy's two answers nginx asks for: /oauth2/auth (202 with the signed-in name,
    or 401 without the session cookie) and the sign-in page."""

    def do_GET(self) -> None:
        if self.path.startswith("/oauth2/auth"):
            if "session=alice" in self.headers.get("Cookie", ""):
                self.send_response(202)
                self.send_header("X-Auth-Request-Preferred-Username", "alice")
            else:
                self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"sign in with your institution\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


def _nginx_site(auth_port: int, medic_port: int, listen_port: int, secret_conf: Path) -> str:
    """The example with the test machine's listener, upstreams and secret include."""
    text = NGINX_EXAMPLE.read_text(encoding="utf-8")
    rewrites = {
        "    listen 443 ssl;\n": f"    listen {LOOPBACK}:{listen_port};\n",
        "    ssl_certificate     /etc/ssl/certs/medic.example.org.pem;\n": "",
        "    ssl_certificate_key /etc/ssl/private/medic.example.org.key;\n": "",
        "    server 127.0.0.1:8765;\n": f"    server {LOOPBACK}:{medic_port};\n",
        "    server 127.0.0.1:4180;\n": f"    server {LOOPBACK}:{auth_port};\n",
        "include /etc/nginx/slurm-medic-secret.conf;": f"include {secret_conf};",
    }
    for old, new in rewrites.items():
        assert text.count(old) == 1, f"the example no longer has {old!r}"
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def nginx_front(tmp_path_factory: pytest.TempPathFactory, server: WebServer) -> Iterator[int]:
    """The example nginx in front of `server`, with the oauth2-proxy stand-in; its port."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).is_file(), "nginx is missing: deploy/install-system-packages installs it"
    work = tmp_path_factory.mktemp("nginx")
    auth = ThreadingHTTPServer((LOOPBACK, 0), _OAuth2ProxyStandIn)
    threading.Thread(target=auth.serve_forever, daemon=True).start()
    secret_conf = work / "slurm-medic-secret.conf"
    secret_conf.write_text(f'proxy_set_header {SECRET_HEADER} "{server.secret}";\n')
    secret_conf.chmod(0o600)
    port = free_port()
    (work / "site.conf").write_text(
        _nginx_site(auth.server_address[1], _port(server), port, secret_conf)
    )
    temp_paths = "\n".join(
        f"    {kind}_temp_path {work}/{kind};" for kind in ("client_body", "proxy", "fastcgi")
    )
    (work / "nginx.conf").write_text(
        f"daemon off;\npid {work}/nginx.pid;\nerror_log {work}/error.log;\n"
        "events {}\n"
        f"http {{\n    access_log off;\n{temp_paths}\n"
        f"    uwsgi_temp_path {work}/uwsgi;\n    scgi_temp_path {work}/scgi;\n"
        f"    include {work}/site.conf;\n}}\n"
    )
    process = subprocess.Popen(
        [nginx, "-p", str(work), "-c", str(work / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _wait_for_port(port, process)
        yield port
    finally:
        process.send_signal(signal.SIGQUIT)
        process.wait(timeout=10)
        auth.shutdown()


def _wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = process.stderr.read().decode() if process.stderr else ""
            raise AssertionError(f"nginx exited: {said}")
        with socket.socket() as probe:
            if probe.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nginx did not listen on {port} within {START_S} s")


def test_nginx_example_names_the_signed_in_person_and_nobody_else(nginx_front: int) -> None:
    # Signed in as alice; whatever names the browser sends are overwritten by nginx.
    forged = {
        "Cookie": "session=alice",
        USER_HEADER: "root",
        SECRET_HEADER: "not-the-secret",
    }
    status, page = _get(nginx_front, "/", forged)
    assert status == 200
    assert '<span class="who">alice</span>' in page
    status, document = _get(nginx_front, "/api/status", {"Cookie": "session=alice"})
    assert status == 200
    assert [row["owner"] for row in json.loads(document)["pending_approvals"]] == ["alice"]


def test_nginx_example_sends_strangers_to_sign_in_and_keeps_metrics_inside(
    nginx_front: int,
) -> None:
    status, page = _get(nginx_front, "/", {USER_HEADER: "root"})
    assert (status, page) == (200, "sign in with your institution\n")
    assert _get(nginx_front, "/metrics", {"Cookie": "session=alice"})[0] == 403


# ---------------------------------------------------------------- Open OnDemand's forwarder


@pytest.fixture(scope="module")
def socket_server(record_url: str) -> Iterator[Path]:
    """`slurm-medic web --socket` in a directory every user may reach, as /run/slurm-medic."""
    directory = Path(tempfile.mkdtemp(prefix="medic-web-", dir="/tmp"))
    directory.chmod(0o755)
    config = directory / "web.toml"
    config.write_text(f'[store]\nurl = "{record_url}"\n', encoding="utf-8")
    config.chmod(0o600)
    path = directory / "web.sock"
    env = {name: value for name, value in os.environ.items() if not name.startswith("SUDO_")}
    process = subprocess.Popen(
        [str(MEDIC), "web", "--socket", str(path), "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_S
        while not path.exists():
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            assert time.monotonic() < deadline, "the socket did not appear"
            time.sleep(0.05)
        yield path
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        shutil.rmtree(directory, ignore_errors=True)


# Run in a process of alice's, as OnDemand's per-user nginx runs the app: one request, its
# status and body as JSON on stdout.
_AS_PASSENGER = """
import io, json, runpy, sys
app = runpy.run_path(sys.argv[1])["application"]
said = {}
def start_response(status, headers):
    said["status"] = status
environ = {
    "REQUEST_METHOD": "GET", "SCRIPT_NAME": sys.argv[2], "PATH_INFO": sys.argv[3],
    "QUERY_STRING": "", "HTTP_HOST": "ondemand.example.org",
    "HTTP_X_FORWARDED_USER": "root", "wsgi.input": io.BytesIO(b""),
}
body = b"".join(app(environ, start_response)).decode("utf-8", "replace")
print(json.dumps({"status": said["status"], "body": body}))
"""


def _through_ondemand(
    socket_path: Path, path: str, user: str, prefix: str = OOD_PREFIX
) -> tuple[str, str]:
    answer = subprocess.run(
        [
            "setpriv",
            f"--reuid={user}",
            f"--regid={user}",
            "--init-groups",
            "/usr/bin/python3",
            "-c",
            _AS_PASSENGER,
            str(OOD_APP),
            prefix,
            path,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={"SLURM_MEDIC_SOCKET": str(socket_path), "PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    said = json.loads(answer.stdout)
    return said["status"], said["body"]


def test_ondemand_forwarder_is_the_person_by_the_kernels_word(socket_path: Path) -> None:
    status, page = _through_ondemand(socket_path, "/", "alice")
    assert status == "200 OK"
    # alice by her uid on the socket; the forged header is nobody's word there.
    assert '<span class="who">alice</span>' in page
    # Every link stays inside OnDemand's prefix.
    assert f'href="{OOD_PREFIX}/runs"' in page
    assert 'href="/runs"' not in page
    status, page = _through_ondemand(socket_path, "/runs", "bob")
    assert status == "200 OK"
    assert '<span class="who">bob</span>' in page
    assert "llama" not in page  # alice's runs are not bob's to see


def test_a_prefix_that_is_not_plain_path_segments_is_ignored(socket_path: Path) -> None:
    for hostile in ("//evil.example", '/x"onmouseover="alert(1)', "javascript:alert(1)"):
        status, page = _through_ondemand(socket_path, "/", "alice", prefix=hostile)
        assert status == "200 OK"
        assert 'href="/runs"' in page
        assert "evil.example" not in page
        assert "alert(1)" not in page


@pytest.fixture
def socket_path(socket_server: Path) -> Path:
    return socket_server
