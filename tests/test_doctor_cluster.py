"""`slurm-medic doctor` on the real local cluster, with a site wired as the devcluster allows:
the real daemon (`slurm-medic run`) on the config's hook socket, the real web page
(`slurm-medic web`) on its unix socket, the service key (a copy) and known_hosts, the record
at this code's schema, and the devcluster's EpilogSlurmctld: slurm-medic's hook behind a
wrapper that sends to the cluster's hook socket, where this module's daemon listens.

The faults are made on this module's own copies (the key) or for the shortest time (slurmdbd,
stopped for one in-process doctor run and started again by `deploy/devcluster/up`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.config import load_settings
from daemon.doctor.facts import ConfigFact
from daemon.doctor.gather import gather
from daemon.doctor.judge import Status, judge
from daemon.store.engine import make_engine
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from tests.devcluster import STATE, DevCluster, script

pytestmark = pytest.mark.cluster

CLI = str(Path(sys.executable).parent / "slurm-medic")
SLURMDBD_PID = STATE / "run" / "slurmdbd.pid"
START_TIMEOUT_S = 60


@dataclass
class Site:
    """A configured slurm-medic beside the cluster: its directory, config and key copy."""

    directory: Path
    config: Path
    key: Path
    cluster: DevCluster

    def config_with(self, name: str, key: Path) -> Path:
        """This site's config with the probe key at `key`."""
        path = self.directory / name
        path.write_text(self.config.read_text().replace(str(self.key), str(key)))
        return path


def clean_environment() -> dict[str, str]:
    """Root as itself: no SUDO_ (its --config would be refused), no SLURM_MEDIC_."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SUDO_", "SLURM_MEDIC_"))
    }


def doctor(config: Path, *extra: str) -> tuple[int, str, float]:
    """`slurm-medic doctor` as an operator runs it: exit status, stdout, seconds."""
    started = time.monotonic()
    done = subprocess.run(
        [CLI, "doctor", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=clean_environment(),
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout, time.monotonic() - started


def checks(stdout: str) -> dict[str, dict[str, Any]]:
    document = json.loads(stdout)
    return {check["name"]: check for check in document["checks"]}


def wait_for_socket(path: Path, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.is_socket():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no socket at {path}; its log:\n{log.read_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def site(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The daemon and the web page running on this module's config, stopped afterwards."""
    directory = tmp_path_factory.mktemp("doctor")
    key = directory / "medic_key"
    shutil.copyfile(devcluster.medic_key, key)
    key.chmod(0o600)
    config = directory / "config.toml"
    config.write_text(
        f'hook_socket = "{devcluster.hook_socket}"\n'
        "[store]\n"
        f'url = "{sqlite_url(directory / "medic.db")}"\n'
        "[policy]\n"
        "dry_run = true\n"  # it shares the cluster with other sessions: it only looks
        "[wedge]\n"
        "enabled = false\n"
        "[probe]\n"
        f'key_path = "{key}"\n'
        f'known_hosts_path = "{devcluster.known_hosts}"\n'
        f'user = "{devcluster.service_user}"\n'
        "connect_timeout_s = 5\n"
        "command_timeout_s = 30\n"
        "[web]\n"
        f'socket = "{directory / "web.sock"}"\n'
    )
    engine = make_engine(StoreSettings(url=sqlite_url(directory / "medic.db")))
    upgrade(engine)
    engine.dispose()
    started: list[subprocess.Popen[bytes]] = []
    try:
        for command, sock in (("run", devcluster.hook_socket), ("web", directory / "web.sock")):
            log = directory / f"{command}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [CLI, command, "--config", str(config)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=clean_environment(),
                    start_new_session=True,
                )
            started.append(process)
            wait_for_socket(sock, process, log)
        yield Site(directory, config, key, devcluster)
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_doctor_on_the_wired_site_finds_all_well(site: Site) -> None:
    status, stdout, seconds = doctor(site.config, "--json")
    found = checks(stdout)
    assert status == 0, stdout
    assert {name: check["status"] for name, check in found.items()} == {
        "config": "ok",
        "record": "ok",
        "slurm": "ok",
        "accounting": "ok",
        "probe": "ok",
        "epilog": "ok",
        "hook socket": "ok",
        "web": "ok",
    }
    assert found["slurm"]["fact"].startswith("scontrol 22.05.8; slurmctld 22.05.8 on ")
    assert found["slurm"]["fact"].endswith(f"answers, cluster {site.cluster.cluster}")
    assert found["accounting"]["fact"].startswith("sacct reads slurmdbd at localhost:6819: ")
    assert " answered the probe over SSH as medic in " in found["probe"]["fact"]
    assert found["probe"]["fact"].split(" ")[0] in {node.name for node in site.cluster.nodes}
    assert found["hook socket"]["fact"] == f"the daemon listens on {site.cluster.hook_socket}"
    assert found["web"]["fact"] == (
        f"slurm-medic web answers /healthz on {site.directory / 'web.sock'}"
    )
    epilog = site.cluster.state_dir / "epilog" / "slurm-medic-epilog"
    assert found["epilog"]["fact"] == (
        f"EpilogSlurmctld runs {epilog}, slurm-medic's hook, executable by the SlurmUser slurm"
    )
    assert seconds < 30, f"doctor took {seconds:.1f} s"
    status, text, _ = doctor(site.config, "--node", "gpu-02")
    assert status == 0
    lines = text.splitlines()
    assert lines[-1] == "all is well"
    assert any(line.startswith("ok    probe        gpu-02 (--node) answered") for line in lines)


def test_doctor_names_a_removed_probe_key_and_still_checks_the_rest(site: Site) -> None:
    key = site.directory / "removed_key"
    shutil.copyfile(site.key, key)
    key.chmod(0o600)
    config = site.config_with("removed-key.toml", key)
    key.unlink()
    status, stdout, _ = doctor(config, "--json")
    found = checks(stdout)
    assert status == 1
    assert found["config"]["status"] == "fail"
    assert f"SSH key {key} is not a readable file" in found["config"]["fact"]
    assert found["probe"] == {
        "name": "probe",
        "status": "warn",
        "fact": "not checked: the config does not load (see config)",
        "action": None,
    }
    assert (found["slurm"]["status"], found["accounting"]["status"]) == ("ok", "ok")


def test_doctor_names_a_key_the_nodes_refuse(site: Site) -> None:
    key = site.directory / "stranger_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30
    )
    status, stdout, _ = doctor(site.config_with("stranger.toml", key), "--json", "--node", "gpu-03")
    probe = checks(stdout)["probe"]
    assert status == 1
    assert probe["status"] == "fail"
    assert probe["fact"].startswith(f"medic@gpu-03:22 refuses the key {key}: ")
    assert f"install {key}.pub in medic's authorized_keys" in probe["action"]


def test_doctor_names_a_stopped_slurmdbd_and_it_is_started_again(site: Site) -> None:
    settings = load_settings(site.config)
    config = ConfigFact(site.config, exists=True)
    pid = int(SLURMDBD_PID.read_text().strip())
    stopped = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
        while Path(f"/proc/{pid}").exists() and time.monotonic() - stopped < 20:
            time.sleep(0.05)
        report = judge(gather(config, settings, node=None))
    finally:
        script(["up"], timeout=240)  # the devcluster's own way to start slurmdbd
        down_s = time.monotonic() - stopped
    by_name = {item.name: item for item in report.items}
    accounting = by_name["accounting"]
    assert accounting.status is Status.FAIL
    assert accounting.fact.startswith(
        "slurmdbd at localhost:6819 refuses connections: slurmdbd is not running"
    )
    assert accounting.action is not None
    assert "systemctl start slurmdbd" in accounting.action
    assert report.exit_code == 1
    # One failing check stops none of the others.
    assert by_name["slurm"].status is Status.OK
    assert by_name["probe"].status is Status.OK
    assert down_s < 30, f"slurmdbd was down {down_s:.1f} s"
    answered = subprocess.run(
        ["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert site.cluster.cluster in answered.stdout.split()
