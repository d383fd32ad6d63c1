"""A relaunch's environment is built on purpose, never the daemon's: sbatch runs with PATH,
LANG (and SLURM_CONF) and the owner's HOME, USER, LOGNAME and SHELL, so nothing the daemon
holds (SLURM_MEDIC_STORE__URL, with the database password) reaches the job or its tasks,
while the template's own exports still reach every srun task."""

from __future__ import annotations

import os
import pwd
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon.process import CommandResult
from daemon.slurm.backend import SlurmCli
from daemon.slurm.sbatch import submission_environment
from tests.devcluster import user_dir, wait_for_end

SECRET_URL = "postgresql+psycopg://medic:hunter2@db/medic"


def owner_entry() -> pwd.struct_passwd:
    return pwd.getpwuid(os.geteuid())


def test_the_submission_environment_is_the_owners_and_nothing_of_the_daemons() -> None:
    owner = owner_entry()
    daemon_environment = {
        "PATH": "/opt/medic/bin:/usr/bin:/bin",
        "LANG": "en_GB.UTF-8",
        "SLURM_CONF": "/etc/slurm-site/slurm.conf",
        "SLURM_MEDIC_STORE__URL": SECRET_URL,
        "SLURM_MEDIC_CONFIG": "/etc/slurm-medic/config.toml",
        "SBATCH_EXPORT": "ALL",
        "SLURM_JOB_ID": "12",
        "HOME": "/root",
        "USER": "root",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "LD_PRELOAD": "/tmp/evil.so",
    }
    assert submission_environment(owner, daemon_environment) == {
        "PATH": "/opt/medic/bin:/usr/bin:/bin",
        "LANG": "en_GB.UTF-8",
        "SLURM_CONF": "/etc/slurm-site/slurm.conf",
        "HOME": owner.pw_dir,
        "USER": owner.pw_name,
        "LOGNAME": owner.pw_name,
        "SHELL": owner.pw_shell or "/bin/sh",
    }


def test_a_bare_daemon_environment_still_gives_a_usable_one() -> None:
    owner = owner_entry()
    environment = submission_environment(owner, {})
    assert environment["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert environment["LANG"] == "C.UTF-8"
    assert "SLURM_CONF" not in environment


@dataclass
class RecordingSeam:
    """Answers sbatch with a job id; records the environment each call ran with."""

    environments: list[Mapping[str, str] | None] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        self.environments.append(env)
        return CommandResult(tuple(argv), 0, "4242\n", "", 0.01)


def test_sbatch_runs_with_the_built_environment_not_the_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_MEDIC_STORE__URL", SECRET_URL)
    monkeypatch.setenv("PATH", "/daemon/bin:/usr/bin")
    seam = RecordingSeam()
    owner = owner_entry()
    assert SlurmCli(runner=seam, euid=0).submit("#!/bin/bash\n", as_user=owner.pw_name) == 4242
    (environment,) = seam.environments
    assert environment == submission_environment(owner, os.environ)
    assert environment is not None
    assert environment["PATH"] == "/daemon/bin:/usr/bin"
    assert not any(name.startswith("SLURM_MEDIC_") for name in environment)


def test_a_backend_given_an_environment_builds_on_that_one() -> None:
    seam = RecordingSeam()
    owner = owner_entry()
    given = {"PATH": "/x/bin", "SLURM_CONF": "/tmp/dead.conf", "SLURM_MEDIC_POLICY__PAUSED": "1"}
    SlurmCli(runner=seam, env=given, euid=0).submit("#!/bin/bash\n", as_user=owner.pw_name)
    (environment,) = seam.environments
    assert environment is not None
    assert (environment["PATH"], environment["SLURM_CONF"]) == ("/x/bin", "/tmp/dead.conf")
    assert "SLURM_MEDIC_POLICY__PAUSED" not in environment


# --------------------------------------------------------------------- the real cluster

USER = "alice"
SCRIPT = """#!/bin/bash
#SBATCH --job-name=medic-env-{tag}
#SBATCH --output={out}
export PYTORCH_ALLOC_CONF=expandable_segments:True
echo "== job"
env | sort
echo "== task"
srun --ntasks=1 env | sort
"""


@pytest.fixture
def work_dir() -> Iterator[Path]:
    with user_dir("medic-relaunch-env", USER) as path:
        yield path


def _section(text: str, name: str) -> dict[str, str]:
    body = text.split(f"== {name}\n", 1)[1].split("\n== ", 1)[0]
    pairs = (line.partition("=") for line in body.splitlines() if "=" in line)
    return {key: value for key, _, value in pairs}


@pytest.mark.cluster
@pytest.mark.usefixtures("devcluster")
def test_no_daemon_variable_reaches_the_job_or_its_task_and_the_templates_export_does(
    work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_MEDIC_STORE__URL", SECRET_URL)
    monkeypatch.setenv("SLURM_MEDIC_POLICY__DRY_RUN", "true")
    monkeypatch.setenv("MEDIC_DAEMON_ONLY", "daemon")
    tag = uuid.uuid4().hex[:8]
    out = work_dir / f"env-{tag}.out"
    job_id = SlurmCli().submit(
        SCRIPT.format(tag=tag, out=out),
        as_user=USER,
        comment=f"medic-{tag}",
        work_dir=str(work_dir),
    )
    assert wait_for_end(str(job_id), 90) == "COMPLETED"
    text = out.read_text()
    job, task = _section(text, "job"), _section(text, "task")
    for environment in (job, task):
        assert not [name for name in environment if name.startswith("SLURM_MEDIC_")]
        assert "MEDIC_DAEMON_ONLY" not in environment
        assert SECRET_URL not in text
        assert environment["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
        assert environment["USER"] == USER
        assert environment["HOME"] == pwd.getpwnam(USER).pw_dir
    assert job["SLURM_JOB_ID"] == str(job_id)
    assert job.get("SLURM_EXPORT_ENV") in (None, "ALL")
