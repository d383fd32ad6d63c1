"""A relaunch gets the owner's rights in Slurm, nothing more (issue 23's first finding).

slurm-medic submits for a job's owner while running as root. Root's `sbatch --uid` kept root's
authority for the script's own `#SBATCH` lines: on the local Slurm 22.05, alice's
`--priority=TOP` jumped ahead of every older job, `--nice=-10000` and `--reboot` were accepted.
Each line below is submitted twice on the real cluster, by alice herself and by slurm-medic's
submission path as root (`SlurmCli.submit`, which the daemon's relaunch and `sudo slurm-medic
submit` both use), and the two must come out the same. The jobs start an hour later, so no node
reboots and nothing runs; each is cancelled at the end.
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon import process
from daemon.process import as_user_argv
from daemon.slurm.backend import SlurmCli
from daemon.slurm.errors import SubmissionError
from daemon.slurm.sbatch import parse_sbatch_parsable
from tests.devcluster import user_dir

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("devcluster")]

USER = "alice"
_FIELD = re.compile(r"\b(Priority|Nice|Reboot|UserId)=(\S*)")


@dataclass(frozen=True)
class Outcome:
    """What slurmctld made of one submission: refused with its words, or the job's fields."""

    refused: str | None = None
    job_id: int | None = None
    priority: int | None = None
    nice: int | None = None
    reboot: str | None = None
    user: str | None = None


@pytest.fixture
def work_dir() -> Iterator[Path]:
    with user_dir("medic-owner-submit", USER) as path:
        yield path


@pytest.fixture
def submitted() -> Iterator[list[int]]:
    """Job ids to cancel once the test is done."""
    ids: list[int] = []
    yield ids
    if ids:
        process.run(["scancel", *map(str, ids)], timeout=30)


def _script(line: str, work_dir: Path) -> str:
    return (
        "#!/bin/bash\n"
        f"#SBATCH {line}\n"
        "#SBATCH --begin=now+3600\n"
        f"#SBATCH --output={work_dir}/%j.out\n"
        "true\n"
    )


def _fields(job_id: int) -> Outcome:
    shown = process.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30, check=True)
    fields = dict(_FIELD.findall(shown.stdout))
    return Outcome(
        job_id=job_id,
        priority=int(fields["Priority"]),
        nice=int(fields["Nice"]),
        reboot=fields.get("Reboot", ""),
        user=fields["UserId"].split("(")[0],
    )


def _by_alice_herself(script: str, work_dir: Path, submitted: list[int]) -> Outcome:
    alice = pwd.getpwnam(USER)
    result = process.run(
        as_user_argv(alice.pw_uid, alice.pw_gid, ["sbatch", "--parsable", f"--chdir={work_dir}"]),
        timeout=30,
        input_text=script,
        cwd=str(work_dir),
    )
    if not result.ok:
        return Outcome(refused=result.stderr)
    job_id, _ = parse_sbatch_parsable(result.stdout)
    submitted.append(job_id)
    return _fields(job_id)


def _through_medic(script: str, work_dir: Path, submitted: list[int]) -> Outcome:
    try:
        job_id = SlurmCli().submit(script, as_user=USER, work_dir=str(work_dir))
    except SubmissionError as error:
        return Outcome(refused=error.stderr)
    submitted.append(job_id)
    return _fields(job_id)


@pytest.mark.parametrize("line", ["--nice=-10000", "--reboot"])
def test_what_slurm_refuses_the_owner_it_refuses_a_relaunch(
    line: str, work_dir: Path, submitted: list[int]
) -> None:
    script = _script(line, work_dir)
    herself = _by_alice_herself(script, work_dir, submitted)
    medic = _through_medic(script, work_dir, submitted)
    assert herself.refused, f"alice's own {line} was accepted: the test proves nothing"
    assert medic.refused is not None, f"slurm-medic's relaunch with {line} was accepted: {medic}"
    assert medic.refused.strip().splitlines()[-1] == herself.refused.strip().splitlines()[-1]


def test_a_relaunch_never_jumps_the_queue(work_dir: Path, submitted: list[int]) -> None:
    """Slurm ignores alice's `--priority=TOP`: her job gets the ordinary priority, which falls by
    one with each later job (priority/basic). The relaunch, submitted after it, must not rise
    above it; under root's `--uid` it got the top priority there is."""
    script = _script("--priority=TOP", work_dir)
    herself = _by_alice_herself(script, work_dir, submitted)
    medic = _through_medic(script, work_dir, submitted)
    assert herself.refused is None, herself
    assert medic.refused is None, medic
    assert medic.user == herself.user == USER
    assert herself.priority is not None
    assert medic.priority is not None
    assert medic.priority <= herself.priority, (herself, medic)
    assert (medic.nice, medic.reboot) == (herself.nice, herself.reboot)


def test_an_ordinary_line_means_the_same_from_the_owner_and_from_a_relaunch(
    work_dir: Path, submitted: list[int]
) -> None:
    script = _script("--nice=100", work_dir)
    herself = _by_alice_herself(script, work_dir, submitted)
    medic = _through_medic(script, work_dir, submitted)
    assert herself.nice == medic.nice == 100
    assert medic.user == USER
