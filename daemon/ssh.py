"""The one SSH seam: run the node probe's forced command on a node, and nothing else.

paramiko with a dedicated key and strict host keys: the known_hosts file the operator
provides is the only source of trust (never the user's own, never auto-added), so an
unknown or changed key is refused with its fingerprints. Connect and command timeouts
bound every call; the output is capped so a broken node cannot fill the daemon's memory.
Every failure is an `SshError` that says which host, and why.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

DEFAULT_MAX_OUTPUT_BYTES = 32 * 1024 * 1024
_READ_CHUNK = 64 * 1024


class SshError(Exception):
    """Something between us and the node's command failed; carries the host."""

    def __init__(self, host: str, message: str) -> None:
        self.host = host
        super().__init__(f"{host}: {message}")


class UnsafeKey(ValueError):
    """The private key file could be read or replaced by someone else: refused, as ssh does."""


class UnknownHostKey(SshError):
    """The node is not in the operator's known_hosts: refused, never added."""


class HostKeyMismatch(SshError):
    """The node's key differs from the one in known_hosts: refused (a rebuilt node or an attack)."""

    def __init__(self, host: str, expected: str, offered: str) -> None:
        self.expected = expected
        self.offered = offered
        super().__init__(
            host, f"host key changed: known_hosts has {expected}, the node offered {offered}"
        )


class Unreachable(SshError):
    """No SSH session could be opened: refused, no route, timed out, handshake failed."""


class AuthenticationFailed(SshError):
    """The node refused our key (not installed, or the service account is locked)."""


class CommandTimedOut(SshError):
    """The node's command ran past the command timeout; the channel was closed."""


class OutputTooLarge(SshError):
    """The node's command printed more than the cap; the rest was not read."""


@dataclass(frozen=True)
class SshTarget:
    """Where to connect: the name known_hosts knows the node by, its port and our account."""

    host: str
    port: int
    user: str


@dataclass(frozen=True)
class SshCredentials:
    """The service key and the operator's known_hosts."""

    key_path: Path
    known_hosts_path: Path


@dataclass(frozen=True)
class RemoteResult:
    """What the node's command printed and how it ended."""

    stdout: str
    stderr: str
    exit_status: int
    duration_s: float


class _RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    """Like paramiko's RejectPolicy, but raises our typed error with the offered fingerprint."""

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        raise UnknownHostKey(
            hostname, f"not in known_hosts (the node offered {_fingerprint(key)}); refused"
        )


def run_remote(
    target: SshTarget,
    command: str,
    *,
    credentials: SshCredentials,
    connect_timeout: float,
    command_timeout: float,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> RemoteResult:
    """Open a session, run `command` (the forced command replaces it anyway), read its output."""
    started = time.monotonic()
    client = _connect(target, credentials, connect_timeout)
    try:
        return _execute(
            client,
            target,
            command,
            timeout=command_timeout,
            cap=max_output_bytes,
            started=started,
        )
    finally:
        client.close()


def check_private_key(path: Path, *, euid: int | None = None) -> None:
    """Refuse a key that is not a regular file owned by this process's user, or that group or
    others may read or write (ssh refuses such a key too: anyone who can read it can probe
    every node as the service, anyone who can write it can swap it)."""
    owner = os.geteuid() if euid is None else euid
    try:
        info = os.stat(path)
    except OSError as error:
        raise UnsafeKey(f"the probe key {path} cannot be read: {error.strerror}") from error
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeKey(f"the probe key {path} is not a regular file")
    if info.st_uid != owner:
        raise UnsafeKey(
            f"the probe key {path} is owned by uid {info.st_uid}, not by this service's user"
            f" (uid {owner}): chown it to that user"
        )
    loose = info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    if loose:
        raise UnsafeKey(
            f"the probe key {path} has mode {stat.S_IMODE(info.st_mode):04o}: group or others"
            f" may read or write it; `chmod 600 {path}`"
        )


def load_key(path: Path) -> paramiko.PKey:
    """Read the service's private key; a missing, unreadable or unsafe key is refused."""
    try:
        check_private_key(path)
    except UnsafeKey as error:
        raise SshError(str(path), str(error)) from error
    try:
        return paramiko.PKey.from_path(path)
    except (OSError, paramiko.SSHException, ValueError) as error:
        raise SshError(str(path), f"cannot read the SSH key: {error}") from error


def _connect(target: SshTarget, credentials: SshCredentials, timeout: float) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    try:
        client.load_host_keys(str(credentials.known_hosts_path))
    except OSError as error:
        raise SshError(target.host, f"cannot read known_hosts: {error}") from error
    client.set_missing_host_key_policy(_RefuseUnknownHost())
    try:
        client.connect(
            hostname=target.host,
            port=target.port,
            username=target.user,
            pkey=load_key(credentials.key_path),
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
            allow_agent=False,
            look_for_keys=False,
        )
    except SshError:
        client.close()
        raise
    except paramiko.BadHostKeyException as error:
        client.close()
        raise HostKeyMismatch(
            target.host, _fingerprint(error.expected_key), _fingerprint(error.key)
        ) from None
    except paramiko.AuthenticationException as error:
        client.close()
        raise AuthenticationFailed(target.host, f"key refused: {error}") from None
    except TimeoutError as error:
        client.close()
        raise Unreachable(target.host, f"connect timed out after {timeout:g}s") from error
    except (OSError, paramiko.SSHException, EOFError) as error:
        client.close()
        raise Unreachable(target.host, _describe(error)) from None
    return client


def _execute(
    client: paramiko.SSHClient,
    target: SshTarget,
    command: str,
    *,
    timeout: float,
    cap: int,
    started: float,
) -> RemoteResult:
    deadline = time.monotonic() + timeout
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise Unreachable(target.host, "the SSH transport closed before the command ran")
    try:
        channel = transport.open_session(timeout=max(deadline - time.monotonic(), 0.1))
        channel.exec_command(command)
        stdout = bytearray()
        while True:
            channel.settimeout(max(deadline - time.monotonic(), 0.01))
            chunk = channel.recv(_READ_CHUNK)
            if not chunk:
                break
            stdout += chunk
            if len(stdout) > cap:
                channel.close()
                raise OutputTooLarge(target.host, f"command printed more than {cap} bytes")
        stderr = bytearray()
        while channel.recv_stderr_ready() and len(stderr) < cap:
            stderr += channel.recv_stderr(_READ_CHUNK)
        if not channel.status_event.wait(max(deadline - time.monotonic(), 0.01)):
            raise TimeoutError("no exit status")
        status = channel.recv_exit_status()
    except TimeoutError:
        raise CommandTimedOut(target.host, f"command timed out after {timeout:g}s") from None
    except (OSError, paramiko.SSHException, EOFError) as error:
        raise Unreachable(target.host, f"session failed: {_describe(error)}") from None
    return RemoteResult(
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        exit_status=status,
        duration_s=time.monotonic() - started,
    )


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        return "connection refused (no sshd listening)"
    return text
