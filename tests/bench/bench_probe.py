"""Fan-out of the node probe to many sshd instances: our prober against ClusterShell's clush.

Sets up its own network namespace `medic-bench` (a veth pair to the root namespace,
10.77.1.1 outside, 10.77.1.101.. inside: a subnet of its own, so the dev cluster's
10.77.0.0/24 is untouched), one OpenSSH sshd per address with its own host key, a
temporary known_hosts and a forced-command key that runs the real `medic-node-probe`
against the `healthy` fixture state. Both tools run that same probe on the same nodes.
Everything is torn down at the end, also after a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon.evidence.prober import NodeProber, ProbeRequest, ProbeSettings
from daemon.evidence.records import ProbeVerdict

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "medic-bench"
HOST_VETH, NS_VETH = "veth-mbench", "eth-mbench"
OUTSIDE = "10.77.1.1"
FIRST = 101
NODE_COUNTS = (32, 64)
REPEATS = 3


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=120)


def address(index: int) -> str:
    return f"10.77.1.{FIRST + index}"


@contextmanager
def namespace(count: int) -> Iterator[None]:
    sh("ip", "netns", "del", NAMESPACE, check=False)
    sh("ip", "link", "del", HOST_VETH, check=False)
    try:
        sh("ip", "netns", "add", NAMESPACE)
        sh("ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NS_VETH)
        sh("ip", "link", "set", NS_VETH, "netns", NAMESPACE)
        sh("ip", "addr", "add", f"{OUTSIDE}/24", "dev", HOST_VETH)
        sh("ip", "link", "set", HOST_VETH, "up")
        inside = ("ip", "netns", "exec", NAMESPACE)
        sh(*inside, "ip", "link", "set", "lo", "up")
        for index in range(count):
            sh(*inside, "ip", "addr", "add", f"{address(index)}/24", "dev", NS_VETH)
        sh(*inside, "ip", "link", "set", NS_VETH, "up")
        yield
    finally:
        sh("ip", "link", "del", HOST_VETH, check=False)
        sh("ip", "netns", "del", NAMESPACE, check=False)


def keygen(path: Path) -> str:
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f", str(path))
    return path.with_suffix(".pub").read_text().strip()


@contextmanager
def sshds(directory: Path, count: int) -> Iterator[tuple[Path, Path]]:
    """`count` sshd listeners; yields (client key, known_hosts)."""
    client_public = keygen(directory / "client")
    probe = REPO / "daemon" / "installable" / "node_probe.py"
    (directory / "authorized_keys").write_text(
        f'command="{probe}",no-pty,no-port-forwarding,no-agent-forwarding,'
        f"no-X11-forwarding {client_public}\n"
    )
    fixture_bin = REPO / "deploy" / "devcluster" / "fixture-bin"
    state = REPO / "deploy" / "devcluster" / "node-states" / "healthy"
    known: list[str] = []
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(count):
            host_key = directory / f"host{index}"
            known.append(f"{address(index)} {keygen(host_key)}")
            config = directory / f"sshd{index}.conf"
            config.write_text(
                f"ListenAddress {address(index)}\nPort 22\nHostKey {host_key}\n"
                f"PidFile {directory / f'sshd{index}.pid'}\n"
                f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
                "PermitRootLogin forced-commands-only\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitTTY no\n"
                "MaxStartups 200\n"
                f"SetEnv PATH={fixture_bin}:/usr/bin:/bin MEDIC_FIXTURE_DIR={state}\n"
            )
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", NAMESPACE, "/usr/sbin/sshd", "-D", "-f", str(config)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        (directory / "known_hosts").write_text("\n".join(known) + "\n")
        for index in range(count):
            wait_port(address(index))
        yield directory / "client", directory / "known_hosts"
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)


def wait_port(host: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as client:
            client.settimeout(1)
            if client.connect_ex((host, 22)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"no sshd on {host}:22")


def time_prober(nodes: list[str], key: Path, known_hosts: Path, concurrency: int) -> float:
    settings = ProbeSettings(
        key_path=key,
        known_hosts_path=known_hosts,
        user="root",
        concurrency=concurrency,
        cache_ttl_s=0,
        command_timeout_s=120,
    )
    prober = NodeProber(settings)
    started = time.perf_counter()
    probes = prober.probe_many([ProbeRequest(node) for node in nodes])
    elapsed = time.perf_counter() - started
    bad = [probe for probe in probes if probe.verdict is not ProbeVerdict.HEALTHY]
    if bad:
        raise RuntimeError(f"{len(bad)} nodes not healthy, e.g. {bad[0].node}: {bad[0].reasons}")
    return elapsed


def time_clush(nodes: list[str], key: Path, known_hosts: Path, fanout: int) -> float:
    ssh_options = (
        f"-i {key} -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes "
        f"-o UserKnownHostsFile={known_hosts} -o GlobalKnownHostsFile=/dev/null"
    )
    argv = ["clush", "-w", ",".join(nodes), "-f", str(fanout), "-l", "root", "-o", ssh_options,
            "medic-node-probe"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.perf_counter() - started
    answered = {line.split(":", 1)[0] for line in done.stdout.splitlines() if '"format"' in line}
    if done.returncode != 0 or len(answered) != len(nodes):
        raise RuntimeError(f"clush: exit {done.returncode}, {len(answered)}/{len(nodes)} answered")
    return elapsed


def main() -> None:
    if os.geteuid() != 0 or shutil.which("clush") is None or not Path("/usr/sbin/sshd").exists():
        print("bench_probe: needs root, OpenSSH's sshd and clush (Debian package clustershell)")
        return
    for count in NODE_COUNTS:
        nodes = [address(index) for index in range(count)]
        with namespace(count), tempfile.TemporaryDirectory(prefix="medic-bench-") as tmp:
            directory = Path(tmp)
            directory.chmod(0o755)
            with sshds(directory, count) as (key, known_hosts):
                one = [time_prober(nodes[:1], key, known_hosts, 1) for _ in range(REPEATS)]
                print(f"one node, one probe: median {statistics.median(one):.2f} s", flush=True)
                for fanout in (16, 32):
                    ours = [time_prober(nodes, key, known_hosts, fanout) for _ in range(REPEATS)]
                    theirs = [time_clush(nodes, key, known_hosts, fanout) for _ in range(REPEATS)]
                    print(
                        f"probe fan-out to {count} sshd, concurrency {fanout}: "
                        f"slurm-medic prober median {statistics.median(ours):.2f} s "
                        f"(min {min(ours):.2f}), clush median {statistics.median(theirs):.2f} s "
                        f"(min {min(theirs):.2f}), {REPEATS} runs each",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
