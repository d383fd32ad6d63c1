"""sbatch and scancel: argv builders and the `--parsable` answer, pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import fold_hostlist
from daemon.slurm.sacct import validate_job_id
from daemon.slurm.scontrol import validate_node_name

_PARSABLE_ANSWER = re.compile(r"^(?P<job_id>[0-9]+)(?:;(?P<cluster>[^\s;]+))?$")
_SIGNAL = re.compile(r"^(?:SIG)?[A-Z0-9]{1,8}$")


@dataclass(frozen=True)
class SubmitRequest:
    """One submission. `comment` is untrusted text: it travels as a single argv element.

    `uid`/`gid` are set only when slurm-medic runs as root and submits for the job's owner.
    `extra_args` come from the launch template, each `--option=value` so that no stray word
    can become the script path.
    """

    comment: str | None = None
    exclude_nodes: tuple[str, ...] = ()
    uid: int | None = None
    gid: int | None = None
    work_dir: str | None = None
    extra_args: tuple[str, ...] = ()


def sbatch_argv(request: SubmitRequest) -> list[str]:
    """sbatch reading the script from stdin; every value its own argv element."""
    argv = ["sbatch", "--parsable"]
    if request.uid is not None:
        argv.append(f"--uid={request.uid}")
    if request.gid is not None:
        argv.append(f"--gid={request.gid}")
    if request.work_dir is not None:
        argv.append(f"--chdir={request.work_dir}")
    if request.comment is not None:
        if "\x00" in request.comment:
            raise ValueError("a comment cannot hold a NUL byte")
        argv.append(f"--comment={request.comment}")
    if request.exclude_nodes:
        names = [validate_node_name(name) for name in request.exclude_nodes]
        argv.append(f"--exclude={fold_hostlist(names)}")
    for arg in request.extra_args:
        if not (arg.startswith("--") and "=" in arg):
            raise ValueError(f"extra sbatch arguments take the form --option=value, got {arg!r}")
    argv.extend(request.extra_args)
    return argv


def parse_sbatch_parsable(stdout: str) -> tuple[int, str | None]:
    """`123` or `123;cluster` (what `sbatch --parsable` prints) into id and cluster.

    sbatch may print warnings before its answer; the answer is the last non-empty line.
    """
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise SlurmParseError("sbatch printed no job id", source="sbatch --parsable")
    match = _PARSABLE_ANSWER.match(lines[-1])
    if match is None:
        raise SlurmParseError(
            "last line is not `id` or `id;cluster`", source="sbatch --parsable", excerpt=lines[-1]
        )
    return int(match.group("job_id")), match.group("cluster")


def scancel_argv(job_id: int | str, signal: str | None = None) -> list[str]:
    """Cancel a job; with a signal, send it to every step and the batch shell instead."""
    argv = ["scancel"]
    if signal is not None:
        if not _SIGNAL.match(signal):
            raise ValueError(f"not a signal name or number: {signal!r}")
        argv += [f"--signal={signal}", "--full"]
    return [*argv, validate_job_id(job_id)]
