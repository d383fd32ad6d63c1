"""Pytest plugin: the real local Slurm cluster (deploy/devcluster) for tests marked `cluster`.

`devcluster` (session scope) runs `deploy/devcluster/up`, which is idempotent and takes a
second on a running cluster, and yields a `DevCluster` built from `status --json`. At the
end of the session it runs `down`, but only if this session brought the cluster up, no
other pytest session is still using it, and DEVCLUSTER_KEEP is not 1: a cluster someone
kept up for a round of parallel test runs is never pulled from under them.

A test decorated with `runs_last` is moved to the end of the session (the down/up cycle
test uses it, so the cluster is torn down only after every other test has used it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from daemon import process

REPO = Path(__file__).resolve().parent.parent
DEVCLUSTER = REPO / "deploy" / "devcluster"
STATE = Path(os.environ.get("DEVCLUSTER_STATE", "/var/lib/slurm-medic-devcluster"))
# Outside the state dir: `down` deletes that, and a session's claim must outlive a cycle.
SESSIONS = Path("/run") / ("slurm-medic-devcluster-sessions" + str(STATE).replace("/", "-"))
UP_TIMEOUT_S = 240
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class DevNode:
    name: str
    address: str
    namespace: str
    fixture_dir: Path
    bin_dir: Path
    host_key_pub: Path


@dataclass
class DevCluster:
    """Where the running cluster's pieces are, as `status --json` reports them."""

    state_dir: Path
    known_hosts: Path
    medic_key: Path
    node_probe: Path
    hook_socket: Path  # where the cluster's EpilogSlurmctld (slurm-medic's hook) sends
    cluster: str
    controller: str
    partition: str
    account: str
    job_users: tuple[str, ...]
    service_user: str
    nodes: tuple[DevNode, ...]
    brought_up: bool  # this session started it (so this session may take it down)

    @classmethod
    def from_status(cls, status: dict[str, Any], *, brought_up: bool) -> DevCluster:
        return cls(
            state_dir=Path(status["state_dir"]),
            known_hosts=Path(status["known_hosts"]),
            medic_key=Path(status["medic_key"]),
            node_probe=Path(status["node_probe"]),
            hook_socket=Path(status["hook_socket"]),
            cluster=status["cluster"],
            controller=status["controller"],
            partition=status["partition"],
            account=status["account"],
            job_users=tuple(status["job_users"]),
            service_user=status["service_user"],
            nodes=tuple(
                DevNode(
                    name=node["name"],
                    address=node["address"],
                    namespace=node["namespace"],
                    fixture_dir=Path(node["fixture_dir"]),
                    bin_dir=Path(node["bin_dir"]),
                    host_key_pub=Path(node["host_key_pub"]),
                )
                for node in status["nodes"]
            ),
            brought_up=brought_up,
        )

    def node(self, name: str) -> DevNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def ssh_argv(self, host: str, *remote: str) -> list[str]:
        """ssh as the service user with its key and strict host keys (the probe's way in)."""
        return [
            "ssh",
            "-i", str(self.medic_key),
            "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "ConnectTimeout=10",
            f"{self.service_user}@{host}",
            *remote,
        ]  # fmt: skip

    def set_node_state(self, node: str, state: str) -> None:
        script(["set-node-state", node, state])

    @contextmanager
    def node_state(self, node: str, state: str) -> Iterator[None]:
        """Give NODE the fixture STATE for the block, then healthy again."""
        self.set_node_state(node, state)
        try:
            yield
        finally:
            self.set_node_state(node, "healthy")

    def node_sshd(self, node: str, action: str) -> None:
        script(["node-sshd", node, action])


def script(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run one of deploy/devcluster's commands; fail loudly with its output."""
    done = subprocess.run(
        [str(DEVCLUSTER / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"deploy/devcluster/{' '.join(argv)} exited {done.returncode}:\n"
            f"{done.stdout}\n{done.stderr}"
        )
    return done


def status() -> tuple[bool, dict[str, Any]]:
    """(all up, the report) from `status --json`."""
    done = subprocess.run(
        [str(DEVCLUSTER / "status"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report: dict[str, Any] = json.loads(done.stdout)
    return done.returncode == 0 and bool(report["ok"]), report


def other_sessions() -> list[int]:
    """Pids of other live pytest sessions that hold a claim on the cluster."""
    pids: list[int] = []
    for entry in SESSIONS.glob("*") if SESSIONS.is_dir() else []:
        try:
            pid = int(entry.name)
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        if Path(f"/proc/{pid}").is_dir():
            pids.append(pid)
        else:
            entry.unlink(missing_ok=True)  # a session that died without cleaning up
    return pids


def claim() -> None:
    SESSIONS.mkdir(parents=True, exist_ok=True)
    (SESSIONS / str(os.getpid())).touch()


def release() -> None:
    (SESSIONS / str(os.getpid())).unlink(missing_ok=True)


def bring_up() -> dict[str, Any]:
    """Run `up` (idempotent) and return the status report that follows it."""
    script(["up"], timeout=UP_TIMEOUT_S)
    ok, report = status()
    if not ok:
        down = [f"{name}: {c['detail']}" for name, c in report["components"].items() if not c["ok"]]
        raise RuntimeError("devcluster up, but status reports: " + "; ".join(down))
    return report


def keep_requested() -> bool:
    return os.environ.get("DEVCLUSTER_KEEP") == "1"


@pytest.fixture(scope="session")
def job_users() -> None:
    """The local cluster's accounts (alice, bob, medic), made for the tests marked `users`
    (reading, submitting or approving as a job's owner) on a machine where the cluster never
    came up; `deploy/devcluster/down --purge` removes them again."""
    if os.geteuid() != 0:
        pytest.fail("making the cluster's users (deploy/devcluster/users) needs root")
    script(["users"])


@pytest.fixture(scope="session")
def devcluster(job_users: None) -> Iterator[DevCluster]:
    """The running local cluster; started for this session when it was not up."""
    if os.geteuid() != 0:
        pytest.fail("the dev cluster needs root (namespaces, daemons, /etc/hosts)")
    was_up, _ = status() if (DEVCLUSTER / "status").exists() else (False, {})
    claim()
    try:
        report = bring_up()
    except BaseException:
        release()
        raise
    cluster = DevCluster.from_status(report, brought_up=not was_up)
    try:
        yield cluster
    finally:
        release()
        if cluster.brought_up and not keep_requested() and not other_sessions():
            script(["down"], timeout=UP_TIMEOUT_S)


def runs_last(function: F) -> F:
    """Mark a test to run after every other test of the session (it disturbs the cluster)."""
    function._devcluster_runs_last = True  # type: ignore[attr-defined]
    return function


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move `runs_last` tests to the end, keeping everyone's relative order."""
    last: list[pytest.Item] = [
        item
        for item in items
        if isinstance(item, pytest.Function)
        and getattr(item.function, "_devcluster_runs_last", False)
    ]
    if last:
        items[:] = [item for item in items if item not in last] + last


@contextmanager
def user_dir(prefix: str, user: str) -> Iterator[Path]:
    """A fresh /tmp/<prefix>-<random> owned by `user`, so a job run as them can write its logs
    and checkpoints there (pytest's tmp_path is root-only); removed afterwards."""
    path = Path(f"/tmp/{prefix}-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    shutil.chown(path, user, user)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sbatch_as(user: str, work_dir: Path, name: str, script: Path) -> str:
    """Submit `script` as `user` (root's `sbatch --uid`), run from `work_dir`; its job id."""
    result = process.run(
        [
            "sbatch",
            f"--uid={user}",
            f"--gid={user}",
            "--parsable",
            f"--chdir={work_dir}",
            f"--job-name={name}",
            str(script),
        ],
        timeout=30,
        check=True,
    )
    return result.stdout.strip().split(";")[0]


def job_state(job_id: str) -> str | None:
    """The job's state as slurmctld shows it (None once slurmctld no longer knows the job)."""
    shown = process.run(["scontrol", "show", "job", "-o", job_id], timeout=15)
    match = re.search(r"\bJobState=(\S+)", shown.stdout)
    return match.group(1) if match else None


def wait_for_end(job_id: str, timeout_s: float) -> str:
    """Poll `scontrol show job` until the job is in a terminal state; that state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end within {timeout_s} s")
