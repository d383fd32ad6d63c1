"""The epilog hook and the daemon's listener over a real unix datagram socket."""

from __future__ import annotations

import os
import pwd
import queue
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import service
from daemon.config import Settings
from daemon.hook import HookError, HookListener, parse_job_id, parse_slurm_user
from daemon.process import CommandResult, run
from daemon.service import Daemon
from daemon.store.engine import make_engine
from daemon.store.settings import StoreSettings, sqlite_url
from tests.devcluster import DevCluster, job_state, sbatch_as, user_dir
from tests.test_actions_store import FakeSlurm
from tests.test_pipeline import FakeFiles

REPO = Path(__file__).parents[1]
EPILOG = REPO / "daemon" / "installable" / "epilog.py"
WAIT_S = 5.0


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short path (sun_path is 108 bytes) that other users may traverse."""
    directory = Path(tempfile.mkdtemp(prefix="hook-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _epilog(path: Path, job_id: str | None, *, prefix: tuple[str, ...] = ()) -> int:
    env = {"PATH": "/usr/bin:/bin", "SLURM_MEDIC_HOOK_SOCKET": str(path)}
    if job_id is not None:
        env["SLURM_JOB_ID"] = job_id
    # The interpreter of the shebang; a hang would be a CommandTimeout, not a slow pass.
    return run([*prefix, sys.executable, "-IS", str(EPILOG)], timeout=10, env=env).returncode


def _listen(path: Path, **kwargs: object) -> tuple[HookListener, queue.Queue[int]]:
    woken: queue.Queue[int] = queue.Queue()
    listener = HookListener(path, on_job=woken.put, **kwargs)  # type: ignore[arg-type]
    listener.start()
    return listener, woken


def _send(path: Path, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(data, str(path))


def test_the_epilog_wakes_the_listener_with_the_job_id(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    listener, woken = _listen(path)
    try:
        assert _epilog(path, "48213") == 0
        assert woken.get(timeout=WAIT_S) == 48213
        assert listener.stats.accepted == 1
    finally:
        listener.stop()
    assert not path.exists()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"0",
        b"-1",
        b"12; rm -rf /",
        b"12 13",
        b"\xff\xfe",
        "\uff11\uff12".encode(),
        b"9" * 20,
        b"1" * 100,
        b"12\n\n",
    ],
)
def test_anything_but_a_job_id_is_refused(socket_dir: Path, data: bytes) -> None:
    path = socket_dir / "hook.sock"
    listener, woken = _listen(path)
    try:
        _send(path, data)
        _send(path, b"7\n")  # datagrams arrive in order: once 7 is seen, the first was handled
        assert woken.get(timeout=WAIT_S) == 7
        assert woken.empty()
        assert (listener.stats.accepted, listener.stats.rejected) == (1, 1)
    finally:
        listener.stop()


def test_job_ids_parse_strictly() -> None:
    assert parse_job_id(b"123\n") == 123
    assert parse_job_id(b"9223372036854775808") is None  # 2**63: no Slurm job id
    assert parse_job_id(b"9223372036854775807") == 2**63 - 1
    assert parse_job_id(b" 123") is None
    assert parse_job_id(b"0123") is None  # one spelling per id (hypothesis found b"01")
    assert parse_job_id(b"0") is None


@given(st.binary(max_size=80))
def test_any_datagram_is_a_plain_job_id_or_nothing(data: bytes) -> None:
    job_id = parse_job_id(data)
    if job_id is not None:
        assert data.rstrip(b"\n") == str(job_id).encode()
        assert data.count(b"\n") <= 1


def _account(name: str) -> pwd.struct_passwd:
    """An account of the tests marked `users` (made by its fixture), looked up when used."""
    return pwd.getpwnam(name)


def _as(account: pwd.struct_passwd) -> tuple[str, ...]:
    return (
        "setpriv",
        "--reuid",
        str(account.pw_uid),
        "--regid",
        str(account.pw_gid),
        "--clear-groups",
    )


@pytest.mark.users
def test_only_allowed_senders_wake_it(socket_dir: Path) -> None:
    alice = _account("alice")
    path = socket_dir / "hook.sock"
    # alice's group may write to the socket: the sender's uid is what refuses her.
    listener, woken = _listen(path, allowed_uids={0}, group=alice.pw_gid)
    try:
        assert _epilog(path, "111", prefix=_as(alice)) == 0
        assert _epilog(path, "222") == 0
        assert woken.get(timeout=WAIT_S) == 222
        assert woken.empty()
        assert listener.stats.rejected == 1
        assert listener.stats.foreign == 1
    finally:
        listener.stop()


def _send_as(account: pwd.struct_passwd, path: Path) -> str:
    """What a plain sendto by `account` ends in: "sent" or the error's name."""
    code = (
        "import errno, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "try:\n    s.sendto(b'5', sys.argv[1]); print('sent')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
    )
    result = run([*_as(account), sys.executable, "-IS", "-c", code, str(path)], timeout=10)
    return result.stdout.strip()


@pytest.mark.users
def test_the_socket_is_writable_by_its_owner_and_the_senders_group_only(
    socket_dir: Path,
) -> None:
    alice, bob = _account("alice"), _account("bob")
    assert alice.pw_gid != bob.pw_gid
    path = socket_dir / "hook.sock"
    listener, woken = _listen(path, allowed_uids={0, alice.pw_uid}, group=alice.pw_gid)
    try:
        info = path.stat()
        assert (info.st_mode & 0o777, info.st_gid) == (0o620, alice.pw_gid)
        assert _send_as(bob, path) == "EACCES"
        assert _send_as(alice, path) == "sent"
        assert woken.get(timeout=WAIT_S) == 5
        assert listener.stats.rejected == 0
    finally:
        listener.stop()
    listener, _woken = _listen(path)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert _send_as(alice, path) == "EACCES"
    finally:
        listener.stop()


@pytest.mark.users
def test_the_senders_group_is_given_without_cap_chown(socket_dir: Path) -> None:
    """The service keeps CAP_SETGID but not CAP_CHOWN: the socket must still get the group."""
    alice = _account("alice")
    path = socket_dir / "hook.sock"
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from daemon.hook import HookListener\n"
        "listener = HookListener(Path(sys.argv[1]), on_job=print, group=int(sys.argv[2]))\n"
        "listener.start()\n"
        "info = os.stat(sys.argv[1])\n"
        "print(info.st_gid, oct(info.st_mode & 0o777))\n"
        "listener.stop()\n"
    )
    argv = ["setpriv", "--bounding-set", "-chown", sys.executable, "-c", code]
    result = run([*argv, str(path), str(alice.pw_gid)], timeout=30, cwd=str(REPO))
    assert result.stdout.split() == [str(alice.pw_gid), "0o620"], result.stderr


def test_a_burst_of_datagrams_wakes_it_at_most_once_per_interval(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    now = [1000.0]
    listener, woken = _listen(path, min_wake_interval_s=1.0, clock=lambda: now[0])
    try:
        for job_id in range(1, 201):
            _send(path, str(job_id).encode())
        _send(path, b"not a job id")  # seen after all of the burst: the burst was handled
        deadline = time.monotonic() + WAIT_S
        while listener.stats.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert woken.get(timeout=WAIT_S) == 1  # the first wakes at once
        assert woken.empty()  # the other 199 wait for the interval to end
        assert (listener.stats.accepted, listener.stats.woken) == (200, 1)
        now[0] += 1.0
        assert woken.get(timeout=WAIT_S) == 200  # one more, with the latest job id
        now[0] += 5.0
        _send(path, b"201")
        assert woken.get(timeout=WAIT_S) == 201
        assert woken.empty()
        assert listener.stats.woken == 3
        assert listener.stats.coalesced == 198
    finally:
        listener.stop()


def test_the_epilog_never_fails_the_job(socket_dir: Path) -> None:
    missing = socket_dir / "nobody-listens.sock"
    assert _epilog(missing, "5") == 0
    assert _epilog(missing, None) == 0
    assert _epilog(missing, "5; reboot") == 0
    not_a_socket = socket_dir / "file"
    not_a_socket.write_text("x")
    assert _epilog(not_a_socket, "5") == 0


def _fill(path: Path) -> int:
    """Send to `path` until its receive queue is full; how many datagrams it took."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for sent in range(1_000_000):
            try:
                sender.sendto(b"1", str(path))
            except BlockingIOError:
                return sent
    raise AssertionError("the socket never filled")


def test_the_epilog_does_not_block_on_a_full_socket(socket_dir: Path) -> None:
    path = socket_dir / "full.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as deaf:
        deaf.bind(str(path))
        assert _fill(path) > 0
        assert _epilog(path, "5") == 0


def test_a_file_in_the_sockets_place_is_left_alone(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    path.write_text("someone's file")
    with pytest.raises(HookError, match="not a socket"):
        HookListener(path, on_job=lambda _job: None).start()
    assert path.read_text() == "someone's file"


def test_a_stale_socket_is_replaced(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stale:
        stale.bind(str(path))
    listener, woken = _listen(path)
    try:
        _send(path, b"99")
        assert woken.get(timeout=WAIT_S) == 99
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        listener.stop()


# ------------------------------------------------------------ who the daemon lets send

SHOW_CONFIG = (
    "Configuration data as of 2026-11-24T07:31:02\n"
    "SlurmctldTimeout        = 120 sec\n"
    "SlurmUser               = {user}\n"
    "SlurmdUser              = root(0)\n"
)


def test_the_slurm_user_is_read_from_scontrol_show_config() -> None:
    assert parse_slurm_user(SHOW_CONFIG.format(user="slurm(64030)")) == ("slurm", 64030)
    assert parse_slurm_user(SHOW_CONFIG.format(user="root(0)")) == ("root", 0)
    assert parse_slurm_user(SHOW_CONFIG.format(user="slurm(x)")) is None
    assert parse_slurm_user(SHOW_CONFIG.format(user="slurm(1)\n")) == ("slurm", 1)
    assert parse_slurm_user("SlurmdUser = root(0)\n") is None


class ShowConfig:
    """The seam answering `scontrol show config` with `stdout` (or failing)."""

    def __init__(self, stdout: str, returncode: int = 0) -> None:
        self.stdout = stdout
        self.returncode = returncode
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], *, timeout: float, **_: object) -> CommandResult:
        self.calls.append(tuple(argv))
        return CommandResult(tuple(argv), self.returncode, self.stdout, "", 0.01)


def _senders(tmp_path: Path, seam: ShowConfig) -> tuple[frozenset[int], int | None]:
    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    daemon = Daemon(
        Settings(), backend=FakeSlurm(), files=FakeFiles({}), engine=engine, run_command=seam
    )
    try:
        return daemon.hook_senders()
    finally:
        engine.dispose()


@pytest.mark.users
def test_the_hook_admits_root_and_the_slurm_user_and_gives_the_socket_its_group(
    tmp_path: Path,
) -> None:
    alice = _account("alice")
    seam = ShowConfig(SHOW_CONFIG.format(user=f"alice({alice.pw_uid})"))
    allowed, group = _senders(tmp_path, seam)
    assert seam.calls == [("scontrol", "show", "config")]
    assert allowed == {0, os.geteuid(), alice.pw_uid}
    assert group == alice.pw_gid


def test_a_slurm_user_that_is_root_needs_no_group(tmp_path: Path) -> None:
    allowed, group = _senders(tmp_path, ShowConfig(SHOW_CONFIG.format(user="root(0)")))
    assert allowed == {0, os.geteuid()}
    assert group is None


@pytest.mark.users
def test_without_scontrol_the_slurm_account_is_the_sender(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bob = _account("bob")
    monkeypatch.setattr(service, "DEFAULT_SLURM_USER", "bob")
    allowed, group = _senders(tmp_path, ShowConfig("", returncode=1))
    assert (allowed, group) == (frozenset({0, os.geteuid(), bob.pw_uid}), bob.pw_gid)
    monkeypatch.setattr(service, "DEFAULT_SLURM_USER", "no-such-account-here")
    allowed, group = _senders(tmp_path, ShowConfig("", returncode=1))
    assert (allowed, group) == (frozenset({0, os.geteuid()}), None)


@pytest.mark.cluster
@pytest.mark.usefixtures("devcluster")
def test_on_the_real_cluster_the_slurm_user_may_send(tmp_path: Path) -> None:
    slurm = pwd.getpwnam("slurm")
    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    daemon = Daemon(Settings(), backend=FakeSlurm(), files=FakeFiles({}), engine=engine)
    try:
        allowed, group = daemon.hook_senders()
        assert (allowed, group) == (frozenset({0, os.geteuid(), slurm.pw_uid}), slurm.pw_gid)
    finally:
        engine.dispose()


@pytest.mark.cluster
def test_the_clusters_epilog_tells_the_listener_that_a_job_ended(devcluster: DevCluster) -> None:
    """slurmctld runs slurm-medic's hook after a real job (EpilogSlurmctld, wired as
    deploy/README.md says), as the SlurmUser, and the listener hears that job's id."""
    slurm = pwd.getpwnam("slurm")
    listener, woken = _listen(
        devcluster.hook_socket, allowed_uids={0, slurm.pw_uid}, group=slurm.pw_gid
    )
    try:
        with user_dir("hook", "alice") as work:
            script = work / "job.sh"
            script.write_text("#!/bin/sh\ntrue\n")
            job_id = int(sbatch_as("alice", work, "hook-epilog", script))
            heard: list[int] = []
            deadline = time.monotonic() + 90
            # Other jobs of the cluster end too: each is heard, this one among them.
            while job_id not in heard and time.monotonic() < deadline:
                try:
                    heard.append(woken.get(timeout=max(0.1, deadline - time.monotonic())))
                except queue.Empty:
                    break
    finally:
        listener.stop()
    assert job_id in heard, f"heard {heard}, state {job_state(str(job_id))}"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_show_config_text_gives_a_slurm_user_or_none(text: str) -> None:
    found = parse_slurm_user(text)
    if found is not None:
        name, uid = found
        assert name
        assert 0 <= uid < 10**10
        assert f"{name}({uid})" in text
