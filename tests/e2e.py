"""End-to-end harness: a real `slurm-medic run` process on its own record, real submissions.

Everything goes through the product's own commands (`db upgrade`, `run`, `submit`,
`approve`, `show`, `web` in a browser) as an operator would run them; the record is only
read, to decide when a stage is over. Scenario templates are the shipped examples with this
machine's paths, an emulated scenario and short pacing; `--overcommit` lets one job take a
single core per node, so several scenarios run at once on the 2-core nodes.

Two limits of the daemon this suite found, and how the harness met them. CLI_WRITE_RACE:
a CLI write (submit, approve) committed while a daemon step was between its first read
and its first write failed that step, or the CLI command, with "database is locked"
(fixed in a4f2b87: every SQLite transaction now begins IMMEDIATE). That made every reader
queue for the write lock behind daemon steps that held it through sacct and SSH probes, and
the harness's own reads failed after the busy timeout (fixed: read-only sessions begin
DEFERRED, and daemon steps end their reads before slow I/O). The harness still runs a
command again on that message, as an operator would. SLURMCTLD_FORGETS: on Slurm 22.05
only slurmctld knows a job's output path, and the dev cluster forgets ended jobs after
MinJobAge=5 s; a job handled later was diagnosed `unknown` for want of its log (the test
`test_a_death_seen_after_slurmctld_forgot_the_job_is_still_diagnosed` now holds the
daemon to it). The harness still submits a phase's jobs before the daemon starts, and
scenarios that die together hang for different NCCL timeouts, five seconds apart.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, TypeVar

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from daemon import process
from daemon.config import DEFAULT_CONFIG_PATH
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import Action, AuditEvent, Incident, Lineage, Proposal
from daemon.store.settings import StoreSettings
from tests.browser import WebServer, web_server

REPO = Path(__file__).resolve().parent.parent
MEDIC = REPO / ".venv" / "bin" / "slurm-medic"
EMULATED_TRAIN = REPO / "deploy" / "devcluster" / "emulated-train"
# The real run: torch on the CPU (and transformers' Trainer for the hf dialect), gloo across
# the nodes, the OOM injected. It runs under this venv's interpreter (Debian's python3, which
# the job user may run).
REAL_TRAIN = (REPO / ".venv" / "bin" / "python", REPO / "deploy" / "devcluster" / "real-train")
USER = "alice"
# Short pacing: a step is 0.05 s.
STEP_SECONDS = "0.05"
LOCKED_RETRIES = 5
FINAL_PROPOSAL_STATES = ("verified", "failed", "rejected", "expired", "superseded")

T = TypeVar("T")


class StageFailed(AssertionError):
    """A stage did not reach its expected outcome in time; the message says which and why."""


@dataclass(frozen=True)
class Scenario:
    """One failure: which shipped example, which preset, which knobs differ, and whether the
    real run (real-train) or the emulation (emulated-train) plays it."""

    name: str
    example: str
    scenario: str
    knobs: Mapping[str, str] = field(default_factory=dict)
    # The presets are sized for one rank per node (host RAM is per node).
    one_rank_per_node: bool = False
    # How long the surviving ranks hang (NCCL's watchdog, or gloo's timeout) before they die.
    nccl_timeout_s: int = 2
    real: bool = True
    # The job's --mem per node: the cgroup limit a real host-RAM run is killed at.
    mem: str | None = None
    # Extra environment of the job (e.g. the real run's REALTRAIN_WORKER_MIB).
    env: Mapping[str, str] = field(default_factory=dict)


def make_template(work_dir: Path, spec: Scenario) -> Path:
    """The shipped example rewritten for this run: paths, scenario, pacing, layout."""
    target = work_dir / f"template-{spec.name}"
    shutil.copytree(REPO / "launch_templates" / spec.example, target)
    toml_path = target / "template.toml"
    toml = toml_path.read_text(encoding="utf-8")
    for knob, value in spec.knobs.items():
        toml = _replace_line(toml, f"{knob} = ", f"{knob} = {value}")
    if spec.one_rank_per_node:
        toml = _replace_line(toml, "ntasks-per-node = ", "ntasks-per-node = 1")
    checkpoints = work_dir / f"ckpt-{spec.name}"
    program = [str(path) for path in REAL_TRAIN] if spec.real else [str(EMULATED_TRAIN)]
    toml = toml.replace('["deploy/devcluster/emulated-train"]', json.dumps(program))
    toml = toml.replace(
        f'"/tmp/slurm-medic-examples/{_example_dir(spec.example)}"', f'"{checkpoints}"'
    )
    toml = _replace_line(toml, "job-name = ", f'job-name = "e2e-{spec.name}"')
    toml = _replace_line(toml, "output = ", f'output = "{work_dir}/%x-%j.out"')
    sbatch = "overcommit = true\n" + (f'mem = "{spec.mem}"\n' if spec.mem else "")
    toml = toml.replace("[sbatch]\n", f"[sbatch]\n{sbatch}")
    toml = toml.replace(
        "[env]\n",
        "[env]\n"
        f'EMULATION_SCENARIO = "{spec.scenario}"\n'
        f'EMULATION_STEP_SECONDS = "{STEP_SECONDS}"\n'
        f'EMULATION_NCCL_TIMEOUT_SECONDS = "{spec.nccl_timeout_s}"\n'
        + "".join(f"{name} = {json.dumps(value)}\n" for name, value in spec.env.items()),
    )
    toml_path.write_text(toml, encoding="utf-8")
    return target


def _example_dir(example: str) -> str:
    return {"hf-trainer": "hf"}.get(example, example)


def _replace_line(toml: str, prefix: str, line: str) -> str:
    lines = toml.splitlines()
    hits = [index for index, text in enumerate(lines) if text.startswith(prefix)]
    if len(hits) != 1:
        raise ValueError(f"template.toml has {len(hits)} lines starting {prefix!r}")
    lines[hits[0]] = line
    return "\n".join(lines) + "\n"


def with_system_config(config: Path, argv: Sequence[str]) -> list[str]:
    """`argv` run with `config` as the system config, without touching the host's /etc.

    Under sudo slurm-medic reads /etc/slurm-medic/config.toml and nothing else, so a
    person's command runs in a private mount namespace where `config`'s directory is
    bind-mounted over /etc/slurm-medic; the mount ends with the command. The mount point is
    created (empty) when the host has none. Arguments travel as argv, never through a shell
    string.
    """
    if config.name != DEFAULT_CONFIG_PATH.name:
        raise ValueError(f"{config} must be named {DEFAULT_CONFIG_PATH.name}")
    DEFAULT_CONFIG_PATH.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    mount_then_run = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return [
        *("unshare", "--mount", "--propagation", "private", "--"),
        *("sh", "-c", mount_then_run, "sh"),
        str(config.parent.resolve()),
        str(DEFAULT_CONFIG_PATH.parent),
        *argv,
    ]


@dataclass
class Medic:
    """One daemon, its config and its SQLite record under a work dir owned by the job user."""

    work_dir: Path
    probe: Mapping[str, str]
    poll_interval_s: float = 1.0
    # How far each poll's window reaches back before the cursor.
    overlap_s: float = 30
    # How long a run that shows a dead rank may keep running before the daemon cancels it.
    wedge_grace_s: float = 30
    # Only the daemon's environment (a crash test's PATH-prepended wrappers).
    daemon_env: Mapping[str, str] = field(default_factory=dict)
    # More config sections, appended as written (`[sweep]`, `[policy]`).
    extra_config: str = ""
    daemon: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    _engine: Engine | None = None

    @property
    def config(self) -> Path:
        return self.work_dir / "config.toml"

    @property
    def database(self) -> Path:
        return self.work_dir / "medic.db"

    @property
    def url(self) -> str:
        return f"sqlite+pysqlite:///{self.database}"

    @property
    def hook_socket(self) -> Path:
        return self.work_dir / "hook.sock"

    @property
    def daemon_log(self) -> Path:
        return self.work_dir / "daemon.log"

    def prepare(self) -> None:
        """Write the config and bring a fresh record to the current schema."""
        self.config.write_text(
            f'hook_socket = "{self.hook_socket}"\n'
            "[store]\n"
            f'url = "{self.url}"\n'
            "[watcher]\n"
            f"poll_interval_s = {self.poll_interval_s}\n"
            f"overlap_s = {self.overlap_s:g}\n"
            "initial_lookback_s = 30\n"
            "running_interval_s = 1\n"
            # A crash test's intent is settled after 10 s, not a minute.
            "reconcile_settle_s = 10\n"
            "[wedge]\n"
            f"grace_s = {self.wedge_grace_s:g}\n"
            "[verify]\n"
            "margin_steps = 2\n"
            "interval_s = 1\n"
            "[probe]\n"
            + "".join(f'{key} = "{value}"\n' for key, value in self.probe.items())
            + "cache_ttl_s = 0\n"
            + self.extra_config,
            encoding="utf-8",
        )
        self.cli("db", "upgrade", "--database", self.url, timeout=120)

    def start(self) -> None:
        """`slurm-medic run` as a real process (its JSON log goes to daemon.log)."""
        if self.daemon is not None and self.daemon.poll() is None:
            raise RuntimeError("the daemon is already running")
        self._log = self.daemon_log.open("ab")
        self.daemon = subprocess.Popen(
            [str(MEDIC), "run", "--config", str(self.config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # The daemon is root itself, never root for someone: a suite run through sudo
            # must not hand it SUDO_UID, or its --config would be refused.
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("SUDO_")},
                **self.daemon_env,
            },
            start_new_session=True,
        )

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM: the step in flight finishes, then the daemon exits; its exit status."""
        return self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> int:
        """SIGKILL to the daemon and every process under it, as systemd's
        KillMode=control-group ends a crashed unit: no child it started (sbatch, ssh, each in
        its own session, so out of the daemon's process group) outlives it. A crash test's
        wrapper left alive would run the real sbatch after its pause: a stray job."""
        if self.daemon is None:
            raise RuntimeError("no daemon was started")
        for pid in stop_tree(self.daemon.pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return self._signal(signal.SIGKILL, 30)

    def _signal(self, signum: int, timeout_s: float) -> int:
        if self.daemon is None:
            raise RuntimeError("no daemon was started")
        if self.daemon.poll() is None:
            self.daemon.send_signal(signum)
        status = self.daemon.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return status

    def alive(self) -> bool:
        return self.daemon is not None and self.daemon.poll() is None

    def cli(
        self, *args: str, as_user: str | None = None, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """One `slurm-medic` command on this record; fails loudly with its output (unless
        `check` is off, for a command whose exit status is the answer).

        As root it names the config in SLURM_MEDIC_CONFIG. For `as_user` it runs as
        `sudo slurm-medic ...` would for that person: SUDO_UID set, no SLURM_MEDIC_ variable
        (sudo resets the environment, and the CLI refuses them under sudo), and this
        record's config read from the system path, /etc/slurm-medic/config.toml.
        """
        if as_user is None:
            argv = [str(MEDIC), *args]
            # Root itself, even when the harness was started through sudo.
            env = {
                name: value for name, value in os.environ.items() if not name.startswith("SUDO_")
            }
            env["SLURM_MEDIC_CONFIG"] = str(self.config)
        else:
            argv = with_system_config(self.config, [str(MEDIC), *args])
            env = {
                name: value
                for name, value in os.environ.items()
                if not name.startswith(("SUDO_", "SLURM_MEDIC_"))
            }
            env |= {"SUDO_UID": str(pwd.getpwnam(as_user).pw_uid), "SUDO_USER": as_user}
        for attempt in range(1, LOCKED_RETRIES + 1):
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=env,
                cwd=self.work_dir,
            )
            # CLI_WRITE_RACE: an operator would run the command again; so does the harness.
            if done.returncode == 0 or "database is locked" not in done.stderr:
                break
            time.sleep(0.5 * attempt)
        if check and done.returncode != 0:
            command = " ".join(args)
            raise StageFailed(
                f"slurm-medic {command} exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        return done

    @contextmanager
    def web(self) -> Iterator[WebServer]:
        """`slurm-medic web` on this record, as root on a free loopback port, trusting
        loopback as the site's proxy (tests/browser.py); stopped on the way out."""
        base = self.config.read_text(encoding="utf-8")
        with web_server(self.work_dir / "web", base) as server:
            yield server

    def submit(self, template: Path) -> tuple[int, int, str]:
        """`slurm-medic submit` as root for the job user: (lineage, job, token)."""
        done = self.cli(
            "submit", str(template), "--as-user", USER, "--work-dir", str(self.work_dir), "--json"
        )
        answer = json.loads(done.stdout)
        return int(answer["lineage"]), int(answer["job"]), str(answer["token"])

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(StoreSettings(url=self.url))
        return self._engine

    @contextmanager
    def session(self) -> Iterator[Session]:
        with make_session_factory(self.engine, read_only=True)() as session:
            yield session

    def proposals(self, lineage_id: int) -> list[Proposal]:
        with self.session() as session:
            return list(
                session.scalars(
                    select(Proposal).where(Proposal.lineage_id == lineage_id).order_by(Proposal.id)
                )
            )

    def incidents(self, lineage_id: int) -> list[Incident]:
        with self.session() as session:
            return list(
                session.scalars(
                    select(Incident).where(Incident.lineage_id == lineage_id).order_by(Incident.id)
                )
            )

    def lineage(self, lineage_id: int) -> Lineage:
        with self.session() as session:
            found = session.get(Lineage, lineage_id)
            if found is None:
                raise StageFailed(f"lineage {lineage_id} is not in the record")
            session.expunge(found)
            return found

    def actions(self, proposal_ids: Sequence[int]) -> list[Action]:
        with self.session() as session:
            return list(
                session.scalars(
                    select(Action).where(Action.proposal_id.in_(proposal_ids)).order_by(Action.id)
                )
            )

    def audit_verbs(self) -> list[str]:
        with self.session() as session:
            return list(session.scalars(select(AuditEvent.verb).order_by(AuditEvent.id)))

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def wait_for(
        self, what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 0.5
    ) -> T:
        """Poll `probe` until it answers; a dead daemon or the deadline fails the stage."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = probe()
            if answer:
                return answer
            if self.daemon is not None and self.daemon.poll() is not None and self._log is not None:
                raise StageFailed(
                    f"{what}: the daemon exited {self.daemon.returncode}; {self.tail()}"
                )
            if time.monotonic() > deadline:
                raise StageFailed(f"{what}: not reached within {timeout_s:.0f} s; {self.tail()}")
            time.sleep(every_s)

    def tail(self, lines: int = 8) -> str:
        if not self.daemon_log.exists():
            return "no daemon log"
        text = self.daemon_log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "daemon log ends:\n" + "\n".join(text[-lines:])

    def proposal_in(self, lineage_id: int, states: Sequence[str]) -> Proposal | None:
        """The lineage's newest proposal, once it is in one of `states`."""
        found = self.proposals(lineage_id)
        if found and found[-1].state in states:
            return found[-1]
        return None


def stop_tree(pid: int) -> list[int]:
    """SIGSTOP `pid`, then each of its descendants: a stopped process starts no new child
    while its children are looked up. The stopped processes, parents first."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return []
    tree = [pid]
    for child in children(pid):
        tree.extend(stop_tree(child))
    return tree


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc/N/stat (this kernel has no
    /proc/N/task/N/children)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # it ended meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        state_and_parent = text.rpartition(")")[2].split()
        if len(state_and_parent) > 1 and int(state_and_parent[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def make_work_dir(prefix: str) -> Path:
    """/tmp/<prefix>-<random> owned by the job user: its logs and checkpoints go there."""
    path = Path(f"/tmp/{prefix}-{uuid.uuid4().hex[:8]}")
    path.mkdir(mode=0o755)
    shutil.chown(path, USER, USER)
    return path


def jobs_with_token(token: str, minutes: int = 30) -> list[int]:
    """Every job Slurm knows (queued, running or ended) whose comment carries `token`."""
    since = (datetime.now(UTC) - timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S")
    done = process.run(
        ["sacct", "-X", "-n", "-P", "-a", "-S", since, "-E", "now", "-o", "JobID,Comment"],
        timeout=30,
        check=True,
    )
    found = set()
    for line in done.stdout.splitlines():
        job, _, comment = line.partition("|")
        if token in comment and job.isdigit():
            found.add(int(job))
    queued = process.run(["squeue", "-h", "-o", "%i|%k"], timeout=30, check=True)
    for line in queued.stdout.splitlines():
        job, _, comment = line.partition("|")
        if token in comment and job.isdigit():
            found.add(int(job))
    return sorted(found)


def accounted_jobs(token: str, timeout_s: float = 15.0) -> list[int]:
    """`jobs_with_token` for a job that must be there: asked again until Slurm shows one. A
    job slurmctld has just forgotten (MinJobAge=5 s here) reaches sacct only once slurmdbd has
    stored its record, a moment later; in between neither squeue nor sacct shows it."""
    deadline = time.monotonic() + timeout_s
    while not (found := jobs_with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def job_log(work_dir: Path, job_id: int) -> str:
    """The job's output file (pattern `%x-%j.out` in the work dir)."""
    matches = list(work_dir.glob(f"*-{job_id}.out"))
    if len(matches) != 1:
        raise StageFailed(f"job {job_id}: {len(matches)} log files in {work_dir}")
    return matches[0].read_text(encoding="utf-8", errors="replace")


def node_reason(node: str) -> tuple[str, str]:
    """(State, Reason) of a node as `sinfo` prints them ("" when it has no reason)."""
    shown = process.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"], timeout=15, check=True
    ).stdout.strip()
    state, _, reason = shown.partition("|")
    return state.upper(), "" if reason == "none" else reason


def node_list(job_id: int) -> list[str]:
    """The nodes a job ran on, from accounting, expanded (`gpu-[01-02]` -> two names)."""
    done = process.run(
        ["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "NodeList"], timeout=15, check=True
    )
    compact = done.stdout.strip()
    names = process.run(["scontrol", "show", "hostnames", compact], timeout=15, check=True)
    return names.stdout.split()
