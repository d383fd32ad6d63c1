"""The local cluster does what the rest of the suite relies on (deploy/devcluster).

Real Slurm 22.05, real sshd: a failing rank's job reaches accounting with its node list,
log line and comment; the probe key runs only the forced command, and only against the
host keys `up` recorded. The last test takes the cluster down, checks nothing is left,
and brings it back.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.devcluster import (
    DEVCLUSTER,
    SESSIONS,
    DevCluster,
    bring_up,
    claim,
    other_sessions,
    runs_last,
    script,
)

pytestmark = pytest.mark.cluster

NODES = ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]
ACCOUNTS = ("alice", "bob", "medic")
# The comment deploy/devcluster/users gives the accounts it makes (lib.sh's USER_TAG).
USER_TAG = "slurm-medic devcluster"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def state_of(job: dict[str, Any]) -> str:
    """dbv0.0.38 (22.05) has state.current as a string; v0.0.40+ as a list of flags."""
    current = job["state"]["current"]
    return str(current[0] if isinstance(current, list) else current)


def sacct_job(job_id: str) -> dict[str, Any] | None:
    done = run(["sacct", "-j", job_id, "--json"])
    assert done.returncode == 0, done.stderr
    jobs = [job for job in json.loads(done.stdout)["jobs"] if str(job["job_id"]) == job_id]
    return jobs[0] if jobs else None


def wait_for_final_record(job_id: str, nodes: str, limit_s: float = 120) -> dict[str, Any]:
    """The finished job's accounting record, once complete.

    22.05 can show a just-ended job for a few seconds with only its batch host as
    NodeList (or still PENDING) until slurmctld's job-start record reaches slurmdbd.
    """
    deadline = time.monotonic() + limit_s
    job: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        job = sacct_job(job_id)
        if job is not None and state_of(job) in TERMINAL and job["nodes"] == nodes:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} has no complete final record: {job}")


@dataclass(frozen=True)
class FinishedJob:
    job_id: str
    token: str
    record: dict[str, Any]
    log: str


@pytest.fixture(scope="module")
def failed_job(devcluster: DevCluster) -> Iterator[FinishedJob]:
    """A 4-node batch job as alice whose srun task 2 exits 1, run to its end."""
    work = Path(f"/tmp/devcluster-test-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    shutil.chown(work, "alice", "alice")
    token = f"medic-test-{uuid.uuid4().hex[:12]}"
    task = work / "task.sh"
    task.write_text(
        "#!/bin/bash\n"
        'echo "task $SLURM_PROCID on $SLURMD_NODENAME"\n'
        '[ "$SLURM_PROCID" != 2 ]  # task 2 fails with exit code 1\n'
    )
    batch = work / "job.sh"
    batch.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=4\n"
        "#SBATCH --ntasks-per-node=1\n"
        "#SBATCH --job-name=devcluster-test\n"
        f"#SBATCH --output={work}/%j.out\n"
        f"srun {task}\n"
    )
    task.chmod(0o755)
    batch.chmod(0o755)
    submit = run(
        [
            "sbatch", "--uid=alice", "--gid=alice", "--parsable",
            f"--comment={token}", f"--chdir={work}", str(batch),
        ]
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    record = wait_for_final_record(job_id, "gpu-[01-04]")
    log = (work / f"{job_id}.out").read_text()
    yield FinishedJob(job_id, token, record, log)
    shutil.rmtree(work, ignore_errors=True)


def test_sinfo_shows_four_nodes_with_eight_gpus(devcluster: DevCluster) -> None:
    done = run(["sinfo", "-h", "-N", "-p", "gpu", "-o", "%N %t %G"])
    assert done.returncode == 0, done.stderr
    rows = sorted(line.split() for line in done.stdout.splitlines())
    assert [row[0] for row in rows] == NODES
    assert all(row[2] == "gpu:8" for row in rows), rows
    states = {row[1] for row in rows}
    # Other sessions' jobs may be running; with none, every node must be idle.
    if run(["squeue", "-h"]).stdout.strip():
        assert states <= {"idle", "mix", "alloc"}, rows
    else:
        assert states == {"idle"}, rows
    partition = run(["sinfo", "-h", "-o", "%P %a"]).stdout.split()
    assert partition == ["gpu*", "up"]  # the default partition


def test_failed_rank_ends_the_job_failed_on_all_four_nodes(failed_job: FinishedJob) -> None:
    record = failed_job.record
    assert state_of(record) == "FAILED"
    assert record["nodes"] == "gpu-[01-04]"
    assert record["user"] == "alice"
    assert "srun: error: gpu-03: task 2: Exited with exit code 1" in failed_job.log


def test_each_task_sees_its_own_node(failed_job: FinishedJob) -> None:
    seen = {
        int(line.split()[1]): line.split()[3]
        for line in failed_job.log.splitlines()
        if line.startswith("task ")
    }
    assert seen == {0: "gpu-01", 1: "gpu-02", 2: "gpu-03", 3: "gpu-04"}


def test_job_comment_reaches_accounting(failed_job: FinishedJob) -> None:
    # AccountingStoreFlags=job_comment: the relaunch token survives into sacct.
    assert failed_job.record["comment"]["job"] == failed_job.token
    plain = run(["sacct", "-X", "-n", "-P", "-j", failed_job.job_id, "-o", "comment"])
    assert plain.stdout.strip() == failed_job.token


def test_a_task_past_its_mem_is_killed_by_the_cgroup_oom_killer(devcluster: DevCluster) -> None:
    """task/cgroup confines RAM: the kernel, not the program, kills a task past --mem, and
    Slurm records it as a real cluster does (the host-RAM kill the daemon diagnoses)."""
    work = Path(f"/tmp/devcluster-test-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    shutil.chown(work, "alice", "alice")
    try:
        batch = work / "job.sh"
        batch.write_text(
            "#!/bin/bash\n"
            "#SBATCH --nodes=1\n"
            "#SBATCH --nodelist=gpu-01\n"
            "#SBATCH --mem=200M\n"
            f"#SBATCH --output={work}/%j.out\n"
            # 600 MiB, 10 MiB at a time, under a 200 MB limit.
            "srun python3 -c 'held = [bytearray(10 << 20) for _ in range(60)]; print(42)'\n"
        )
        batch.chmod(0o755)
        submit = run(
            ["sbatch", "--uid=alice", "--gid=alice", "--parsable", f"--chdir={work}", str(batch)]
        )
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        record = wait_for_final_record(job_id, "gpu-01")
        steps = {step["step"]["name"]: step for step in record["steps"]}
        log = (work / f"{job_id}.out").read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "42" not in log.splitlines()
    assert "srun: error: gpu-01: task 0: Out Of Memory" in log
    assert f"Detected 1 oom-kill event(s) in StepId={job_id}.0" in log
    step_state = steps["python3"]["state"]
    assert step_state == "OUT_OF_MEMORY" or step_state == ["OUT_OF_MEMORY"], steps


def test_status_reports_every_component(devcluster: DevCluster) -> None:
    done = run([str(DEVCLUSTER / "status"), "--json"])
    assert done.returncode == 0, done.stdout
    report = json.loads(done.stdout)
    names = set(report["components"])
    expected = {"munge", "mariadb", "slurmdbd", "slurmctld", "sinfo"}
    expected |= {f"slurmd {node}" for node in NODES} | {f"sshd {node}" for node in NODES}
    assert expected <= names
    assert [node["address"] for node in report["nodes"]] == [f"10.77.0.1{i}" for i in range(1, 5)]
    assert Path(report["known_hosts"]).is_file()
    assert Path(report["medic_key"]).is_file()


def test_up_on_a_running_cluster_starts_nothing(devcluster: DevCluster) -> None:
    started = time.monotonic()
    done = script(["up"])
    assert time.monotonic() - started < 30
    assert "nothing started" in done.stdout, done.stdout


@pytest.mark.parametrize("node", NODES)
def test_medic_key_runs_only_the_forced_command(devcluster: DevCluster, node: str) -> None:
    address = devcluster.node(node).address
    for host in (node, address):  # known_hosts holds each node under both
        done = run(devcluster.ssh_argv(host, "id"))
        assert done.returncode == 0, done.stderr
        assert not done.stdout.startswith("uid="), "a shell ran the client's command"
        document = json.loads(done.stdout)
        assert document["format"] == "medic-node-probe/1"
        assert document["node"] == node  # this node's sshd set MEDIC_NODE


def test_node_state_changes_what_the_node_reports(devcluster: DevCluster) -> None:
    fixture = DEVCLUSTER / "node-states" / "xid79" / "dmesg.txt"
    # Fixture lines are "<seconds before now> <message>"; the tool prints real times.
    xid79 = [line.split(" ", 1)[1] for line in fixture.read_text().splitlines() if "): 79," in line]
    assert xid79
    node = "gpu-04"
    with devcluster.node_state(node, "xid79"):
        faulty = run(devcluster.ssh_argv(node)).stdout
        neighbour = run(devcluster.ssh_argv("gpu-01")).stdout
    assert xid79[0] in faulty
    assert xid79[0] not in neighbour
    assert xid79[0] not in run(devcluster.ssh_argv(node)).stdout  # healthy again


def test_rekeyed_node_is_refused_by_a_strict_client(devcluster: DevCluster) -> None:
    devcluster.node_sshd("gpu-02", "rekey")
    try:
        done = run(devcluster.ssh_argv("gpu-02", "id"))
        assert done.returncode == 255
        assert "Host key verification failed" in done.stderr
        assert done.stdout == ""
    finally:
        devcluster.node_sshd("gpu-02", "restore")
    assert run(devcluster.ssh_argv("gpu-02", "id")).returncode == 0


def leftovers() -> list[str]:
    """Everything of the cluster's that is still on the machine."""
    found: list[str] = []
    namespaces = run(["ip", "netns", "list"]).stdout.split()
    found += [f"namespace {ns}" for ns in ("n1", "n2", "n3", "n4") if ns in namespaces]
    links = run(["ip", "-o", "link", "show"]).stdout
    found += [f"link {name}" for name in ("br-slurm", "veth-n1", "veth-n4") if f" {name}" in links]
    hosts = Path("/etc/hosts").read_text()
    found += [f"/etc/hosts: {line}" for line in hosts.splitlines() if "gpu-0" in line]
    found += [f for f in ("/etc/slurm/slurm.conf", "/etc/slurm/slurmdbd.conf") if Path(f).exists()]
    state = os.environ.get("DEVCLUSTER_STATE", "/var/lib/slurm-medic-devcluster")
    if Path(state).exists():
        found.append(state)
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            comm = (proc / "comm").read_text().strip()
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "State:\tZ" in status:
            continue  # a zombie holds nothing; this container's init may not reap
        ours = comm in {"slurmctld", "slurmdbd", "slurmd", "slurmstepd", "slurmscriptd"}
        ours |= comm in {"sshd", "mariadbd"} and state in cmdline
        if ours:
            found.append(f"process {proc.name} {comm} {cmdline.strip()}")
    return found


@runs_last
def test_down_leaves_nothing_behind_and_up_comes_back(devcluster: DevCluster) -> None:
    if os.environ.get("DEVCLUSTER_TEST_TEARDOWN") != "1" and (
        not devcluster.brought_up or other_sessions()
    ):
        pytest.skip(
            "the cluster was already up or other sessions use it: not tearing it down "
            "(DEVCLUSTER_TEST_TEARDOWN=1 forces it)"
        )
    script(["down", "--purge"], timeout=120)
    assert leftovers() == []
    # --purge took the accounts `users` made (an account of the same name it did not make stays).
    assert [entry.pw_name for entry in pwd.getpwall() if entry.pw_gecos == USER_TAG] == []
    started = time.monotonic()
    bring_up()
    # `up` makes the accounts again (each lookup raises KeyError if one is missing).
    assert [pwd.getpwnam(user).pw_name for user in ACCOUNTS] == list(ACCOUNTS)
    claim()  # the claim dir is outside the state dir, but be sure the session still holds it
    assert SESSIONS.is_dir()
    assert time.monotonic() - started < 120
    assert run(devcluster.ssh_argv("gpu-01")).returncode == 0
