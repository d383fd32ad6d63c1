"""sbatch and scancel: argv builders, the submission's environment and the `--parsable`
answer, pure."""

from __future__ import annotations

import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass

from daemon.process import as_user_argv
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.hostlist import fold_hostlist
from daemon.slurm.records import MAX_JOB_ID
from daemon.slurm.sacct import validate_job_id
from daemon.slurm.scontrol import validate_node_name

_PARSABLE_ANSWER = re.compile(r"(?P<job_id>[0-9]{1,10})(?:;(?P<cluster>[^\s;]{1,256}))?\Z")
_SIGNAL = re.compile(r"(?:SIG)?[A-Z0-9]{1,8}\Z")
# What a submission keeps of the submitting process's environment: where the commands are,
# the language, and where Slurm's own configuration is when it is not in the default place.
INHERITED_VARIABLES = ("PATH", "LANG", "SLURM_CONF")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_LANG = "C.UTF-8"


@dataclass(frozen=True)
class SubmitRequest:
    """One submission. `comment` is untrusted text: it travels as a single argv element.

    `uid`/`gid` are set only when slurm-medic runs as root and submits for the job's owner:
    sbatch then runs as the owner's own process (`as_user_argv`), never as root with `--uid`,
    so slurmctld grants exactly what the owner may do (root's `--uid` keeps root's authority for
    the script's `#SBATCH --priority`, `--nice=-N` and `--reboot`).
    `extra_args` come from the launch template, each `--option=value` so that no stray word
    can become the script path.
    """

    comment: str | None = None
    exclude_nodes: tuple[str, ...] = ()
    uid: int | None = None
    gid: int | None = None
    work_dir: str | None = None
    extra_args: tuple[str, ...] = ()


def submitter_ids(owner: pwd.struct_passwd, euid: int) -> tuple[int | None, int | None]:
    """The `SubmitRequest` ids for a submission of `owner`'s job by a process of `euid`: root
    runs sbatch as the owner's own process, anyone else only as themself (no ids). One rule for
    the argv that runs and the argv the record keeps, so the record names what ran."""
    if euid == 0:
        return owner.pw_uid, owner.pw_gid
    return None, None


def sbatch_argv(request: SubmitRequest) -> list[str]:
    """sbatch reading the script from stdin, as the owner's process when `uid` is set; every
    value its own argv element."""
    if (request.uid is None) != (request.gid is None):
        raise ValueError("a submission for an owner names both their uid and gid")
    argv = ["sbatch", "--parsable"]
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
    if request.uid is not None and request.gid is not None:
        return as_user_argv(request.uid, request.gid, argv)
    return argv


def submission_environment(
    owner: pwd.struct_passwd, inherited: Mapping[str, str]
) -> dict[str, str]:
    """The whole environment sbatch runs with, built on purpose: PATH, LANG (and SLURM_CONF)
    from the submitter, HOME, USER, LOGNAME and SHELL from the owner's passwd entry.

    sbatch exports its own environment into the job, so this is the job's starting
    environment too; the script's own `export`s (the launch template's) come on top.
    Not `sbatch --export=NONE`, for two reasons (22.05's sbatch(1), and seen on the dev
    cluster): NONE still passes every SLURM_* variable of sbatch's environment into the job
    (SLURM_MEDIC_STORE__URL, with the database password, is one), and it sets
    SLURM_EXPORT_ENV=NONE in the job, so every `srun` of the script starts its tasks without
    the script's exports (the allocator setting a fix depends on never reaches the ranks;
    even PATH is gone). With an environment that holds nothing of the daemon's, sbatch's
    default (ALL) exports only what is here, srun hands the script's exports on to every
    task, and a template's own `#SBATCH --export=...` still gets what it asks for.
    """
    environment = {
        "PATH": inherited.get("PATH") or DEFAULT_PATH,
        "LANG": inherited.get("LANG") or DEFAULT_LANG,
        "HOME": owner.pw_dir,
        "USER": owner.pw_name,
        "LOGNAME": owner.pw_name,
        "SHELL": owner.pw_shell or "/bin/sh",
    }
    for name in INHERITED_VARIABLES:
        if name not in environment and inherited.get(name):
            environment[name] = inherited[name]
    return environment


def parse_sbatch_parsable(stdout: str) -> tuple[int, str | None]:
    """`123` or `123;cluster` (what `sbatch --parsable` prints) into id and cluster.

    sbatch may print warnings before its answer; the answer is the last non-empty line.
    """
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise SlurmParseError("sbatch printed no job id", source="sbatch --parsable")
    match = _PARSABLE_ANSWER.match(lines[-1])
    if match is None or not 0 < int(match.group("job_id")) <= MAX_JOB_ID:
        raise SlurmParseError(
            "last line is not `id` or `id;cluster`",
            source="sbatch --parsable",
            excerpt=lines[-1][:200],
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
