"""The SSH seam against a real OpenSSH sshd started by these tests on 127.0.0.1.

The key is restricted by a forced command in authorized_keys, as on the nodes. The forced
command here is a small test dispatcher: it runs the real `medic-node-probe` (against a
dev-cluster node state) or, for the seam's own tests, prints, sleeps or fails on request.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon.cli import main
from daemon.evidence.prober import NodeProber, ProbeRequest, ProbeSettings
from daemon.evidence.records import ProbeVerdict
from daemon.ssh import (
    AuthenticationFailed,
    CommandTimedOut,
    HostKeyMismatch,
    OutputTooLarge,
    SshCredentials,
    SshError,
    SshTarget,
    UnknownHostKey,
    Unreachable,
    UnsafeKey,
    check_private_key,
    run_remote,
)

REPO = Path(__file__).parent.parent
SSHD = Path("/usr/sbin/sshd")
# OpenSSH's sshd and ssh-keygen come with the system packages; sshd here runs as root.
needs_sshd = pytest.mark.root

DISPATCH = """#!/bin/sh
case "$SSH_ORIGINAL_COMMAND" in
    medic-node-probe) exec {probe} ;;
    echo) echo "out"; echo "err" >&2; exit 0 ;;
    fail) echo "boom" >&2; exit 7 ;;
    sleep) exec sleep 30 ;;
    flood) exec head -c 3000000 /dev/zero ;;
    *) echo "refused: $SSH_ORIGINAL_COMMAND" >&2; exit 126 ;;
esac
"""


@dataclass(frozen=True)
class LocalSshd:
    """A running sshd and the files a client needs to reach it."""

    port: int
    key: Path
    known_hosts: Path
    host_public_key: str
    directory: Path

    def target(self) -> SshTarget:
        return SshTarget(host="127.0.0.1", port=self.port, user="root")

    def credentials(
        self, *, known_hosts: Path | None = None, key: Path | None = None
    ) -> SshCredentials:
        return SshCredentials(key or self.key, known_hosts or self.known_hosts)


def keygen(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test", "-f", str(path)], check=True
    )
    return path.with_suffix(".pub").read_text().strip()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not listen on {port}")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSshd]:
    directory = tmp_path_factory.mktemp("sshd")
    directory.chmod(0o755)
    host_public = keygen(directory / "host_key")
    client_public = keygen(directory / "client_key")
    dispatch = directory / "dispatch"
    dispatch.write_text(DISPATCH.format(probe=REPO / "daemon" / "installable" / "node_probe.py"))
    dispatch.chmod(0o755)
    (directory / "authorized_keys").write_text(
        f'command="{dispatch}",no-pty,no-port-forwarding,no-agent-forwarding,'
        f"no-X11-forwarding {client_public}\n"
    )
    port = free_port()
    fixture_bin = REPO / "deploy" / "devcluster" / "fixture-bin"
    state = REPO / "deploy" / "devcluster" / "node-states" / "cotenant"
    config = directory / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {directory / 'host_key'}\n"
        f"PidFile {directory / 'sshd.pid'}\nAuthorizedKeysFile {directory / 'authorized_keys'}\n"
        "PermitRootLogin forced-commands-only\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitTTY no\n"
        f"SetEnv PATH={fixture_bin}:/usr/bin:/bin MEDIC_FIXTURE_DIR={state}\n"
    )
    known_hosts = directory / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_public}\n")
    process = subprocess.Popen(
        [str(SSHD), "-D", "-e", "-f", str(config)], stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port(port)
        yield LocalSshd(port, directory / "client_key", known_hosts, host_public, directory)
    finally:
        process.terminate()
        process.wait(timeout=10)


@needs_sshd
def test_command_output_and_exit_status(sshd: LocalSshd) -> None:
    result = run_remote(
        sshd.target(), "echo", credentials=sshd.credentials(), connect_timeout=5, command_timeout=10
    )
    assert (result.stdout, result.stderr, result.exit_status) == ("out\n", "err\n", 0)


@needs_sshd
def test_failing_command_reports_its_status(sshd: LocalSshd) -> None:
    result = run_remote(
        sshd.target(), "fail", credentials=sshd.credentials(), connect_timeout=5, command_timeout=10
    )
    assert (result.exit_status, result.stderr) == (7, "boom\n")


@needs_sshd
def test_forced_command_refuses_anything_else(sshd: LocalSshd) -> None:
    result = run_remote(
        sshd.target(),
        "cat /etc/shadow",
        credentials=sshd.credentials(),
        connect_timeout=5,
        command_timeout=10,
    )
    assert result.exit_status == 126
    assert result.stdout == ""


@needs_sshd
def test_command_timeout_is_bounded(sshd: LocalSshd) -> None:
    started = time.monotonic()
    with pytest.raises(CommandTimedOut, match=r"127\.0\.0\.1: command timed out after 1s"):
        run_remote(
            sshd.target(),
            "sleep",
            credentials=sshd.credentials(),
            connect_timeout=5,
            command_timeout=1,
        )
    assert time.monotonic() - started < 5


@needs_sshd
def test_output_over_the_cap_is_refused(sshd: LocalSshd) -> None:
    with pytest.raises(OutputTooLarge, match="more than 1048576 bytes"):
        run_remote(
            sshd.target(),
            "flood",
            credentials=sshd.credentials(),
            connect_timeout=5,
            command_timeout=10,
            max_output_bytes=1024 * 1024,
        )


@needs_sshd
def test_unknown_host_key_is_refused_and_not_added(sshd: LocalSshd, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(UnknownHostKey, match=r"not in known_hosts .*ssh-ed25519 SHA256:"):
        run_remote(
            sshd.target(),
            "echo",
            credentials=sshd.credentials(known_hosts=empty),
            connect_timeout=5,
            command_timeout=10,
        )
    assert empty.read_text() == ""


@needs_sshd
def test_changed_host_key_is_refused_with_both_fingerprints(
    sshd: LocalSshd, tmp_path: Path
) -> None:
    other = keygen(tmp_path / "other")
    stale = tmp_path / "known_hosts"
    stale.write_text(f"[127.0.0.1]:{sshd.port} {other}\n")
    with pytest.raises(HostKeyMismatch) as raised:
        run_remote(
            sshd.target(),
            "echo",
            credentials=sshd.credentials(known_hosts=stale),
            connect_timeout=5,
            command_timeout=10,
        )
    assert raised.value.expected != raised.value.offered
    assert raised.value.expected.startswith("ssh-ed25519 SHA256:")
    assert stale.read_text() == f"[127.0.0.1]:{sshd.port} {other}\n"


@needs_sshd
def test_wrong_key_is_an_authentication_failure(sshd: LocalSshd, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger")
    with pytest.raises(AuthenticationFailed):
        run_remote(
            sshd.target(),
            "echo",
            credentials=sshd.credentials(key=tmp_path / "stranger"),
            connect_timeout=5,
            command_timeout=10,
        )


def test_closed_port_is_unreachable(tmp_path: Path) -> None:
    keygen(tmp_path / "key")
    (tmp_path / "known_hosts").write_text("")
    with pytest.raises(Unreachable, match="connection refused"):
        run_remote(
            SshTarget("127.0.0.1", free_port(), "root"),
            "echo",
            credentials=SshCredentials(tmp_path / "key", tmp_path / "known_hosts"),
            connect_timeout=2,
            command_timeout=2,
        )


def test_silent_listener_times_out_as_unreachable(tmp_path: Path) -> None:
    keygen(tmp_path / "key")
    (tmp_path / "known_hosts").write_text("")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(Unreachable):
            run_remote(
                SshTarget("127.0.0.1", port, "root"),
                "echo",
                credentials=SshCredentials(tmp_path / "key", tmp_path / "known_hosts"),
                connect_timeout=1,
                command_timeout=1,
            )
        assert time.monotonic() - started < 5


@needs_sshd
def test_prober_end_to_end_through_real_sshd(sshd: LocalSshd) -> None:
    settings = ProbeSettings(
        key_path=sshd.key, known_hosts_path=sshd.known_hosts, user="root", port=sshd.port
    )
    prober = NodeProber(settings)
    first, second = prober.probe_many([ProbeRequest("127.0.0.1"), ProbeRequest("127.0.0.1")])
    assert first.verdict is ProbeVerdict.DEGRADED  # the cotenant state: 30 GiB on GPU 3
    assert first.reasons[0] == "GPU 3 (00000000:4E:00.0): pid 31337 (python3) holds 30.0 GiB"
    assert second == first
    assert prober.fetch_count == 1


@needs_sshd
def test_probe_command_prints_the_record_as_json(sshd: LocalSshd) -> None:
    args = [
        "probe",
        "127.0.0.1",
        "--key",
        str(sshd.key),
        "--known-hosts",
        str(sshd.known_hosts),
        "--user",
        "root",
        "--port",
        str(sshd.port),
        "--since-minutes",
        "10",
        "--json",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["verdict"] == "degraded"
    assert record["gpus"][3]["compute_apps"][0]["pid"] == 31337
    assert record["gpus"][3]["compute_apps"][0]["used_bytes"] == 30 * 1024**3


def test_probe_command_exit_code_for_an_unreachable_node(tmp_path: Path) -> None:
    keygen(tmp_path / "key")
    (tmp_path / "known_hosts").write_text("")
    args = [
        "probe",
        "127.0.0.1",
        "--key",
        str(tmp_path / "key"),
        "--known-hosts",
        str(tmp_path / "known_hosts"),
        "--user",
        "root",
        "--port",
        str(free_port()),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3
    assert result.output.startswith("127.0.0.1: unreachable\n")
    assert "connection refused" in result.output


# ------------------------------------------------------------- the key's own file, like ssh


def _key_with_mode(tmp_path: Path, mode: int) -> Path:
    key = tmp_path / "key"
    keygen(key)
    key.chmod(mode)
    return key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644, 0o660])
def test_a_key_group_or_others_may_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    key = _key_with_mode(tmp_path, mode)
    with pytest.raises(UnsafeKey, match=f"mode 0{mode:o}: group or others may read or write"):
        check_private_key(key)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_key_only_its_owner_may_use_is_accepted(tmp_path: Path, mode: int) -> None:
    key = _key_with_mode(tmp_path, mode)
    check_private_key(key)
    assert key.stat().st_uid == os.geteuid()


def test_a_key_owned_by_someone_else_or_not_a_file_is_refused(tmp_path: Path) -> None:
    key = _key_with_mode(tmp_path, 0o600)
    with pytest.raises(UnsafeKey, match=f"owned by uid {os.geteuid()}, not by"):
        check_private_key(key, euid=os.geteuid() + 1)
    with pytest.raises(UnsafeKey, match="not a regular file"):
        check_private_key(tmp_path)
    with pytest.raises(UnsafeKey, match="cannot be read"):
        check_private_key(tmp_path / "missing")


def test_the_prober_refuses_an_unsafe_key_when_it_is_made(tmp_path: Path) -> None:
    key = _key_with_mode(tmp_path, 0o644)
    (tmp_path / "known_hosts").write_text("")
    settings = ProbeSettings(key_path=key, known_hosts_path=tmp_path / "known_hosts")
    with pytest.raises(UnsafeKey, match="chmod 600"):
        NodeProber(settings)
    key.chmod(0o600)
    assert NodeProber(settings).fetch_count == 0


def test_a_key_made_unsafe_later_is_refused_at_connect(tmp_path: Path) -> None:
    key = _key_with_mode(tmp_path, 0o600)
    (tmp_path / "known_hosts").write_text("")
    key.chmod(0o640)
    with pytest.raises(SshError, match="group or others may read or write"):
        run_remote(
            SshTarget("127.0.0.1", free_port(), "root"),
            "echo",
            credentials=SshCredentials(key, tmp_path / "known_hosts"),
            connect_timeout=2,
            command_timeout=2,
        )


def test_probe_command_refuses_an_unsafe_key_as_a_usage_error(tmp_path: Path) -> None:
    key = _key_with_mode(tmp_path, 0o644)
    (tmp_path / "known_hosts").write_text("")
    args = ["probe", "gpu-01", "--key", str(key), "--known-hosts", str(tmp_path / "known_hosts")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "group or others may read or write it" in result.output
