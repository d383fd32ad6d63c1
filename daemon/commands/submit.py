"""`slurm-medic submit TEMPLATE`: start a lineage and submit its first revision.

One protocol with the daemon's relaunches (`daemon.submission`): the revision is recorded and
the intent with its token committed before sbatch runs; the token travels in the job's
comment, so the daemon can tie the job to the lineage whatever happens next.

Exit codes: 0 submitted; 1 the template cannot be used; 2 usage, a config that cannot be
used, or a setting refused under sudo; 4 the record cannot be used; 5 sbatch refused.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import TYPE_CHECKING

import click

from daemon.commands.context import CommandContext, config_option, json_option, say
from daemon.commands.paths import typed_path
from daemon.commands.terminal import printable
from daemon.privilege import sudo_caller

if TYPE_CHECKING:
    from daemon.owner_files import Owner

EXIT_CONFIG = 2
EXIT_SUBMIT = 5


@click.command("submit")
# Neither path is looked at here: under sudo this process is root, and whether a path exists
# or where its links lead is for the owner's rights to answer (their reader, their `test -d`).
@click.argument("template_dir", callback=typed_path)
@click.option("--as-user", help="Submit as this user (root only; default: yourself).")
@click.option(
    "--work-dir",
    callback=typed_path,
    metavar="DIR",
    help="The job's working directory (default: the current directory).",
)
@config_option
@json_option
def submit_command(
    template_dir: str,
    as_user: str | None,
    work_dir: str | None,
    config_path: str | None,
    as_json: bool,
) -> None:
    """Submit TEMPLATE_DIR's launch template as a new lineage slurm-medic looks after."""
    from daemon.owner_files import Owner, OwnerReadRefused  # noqa: PLC0415
    from daemon.store import repository as repo  # noqa: PLC0415
    from daemon.submission import Sbatch, submit_new_lineage  # noqa: PLC0415
    from daemon.templates.bounded import read_template_bounded  # noqa: PLC0415
    from daemon.templates.model import TemplateError  # noqa: PLC0415
    from daemon.templates.reading import load_template  # noqa: PLC0415
    from daemon.templates.revisions import initial_revision, knobs_to_json  # noqa: PLC0415

    context = CommandContext.load(
        config_path, as_json=as_json, prefix="slurm-medic submit", config_exit=EXIT_CONFIG
    )
    # Under sudo the person is the one who ran it, and they may submit only as themselves:
    # root's right to submit for others is not theirs (deploy/README.md, "Privilege model").
    caller = sudo_caller(os.environ, os.getuid())
    real_uid = os.getuid() if caller is None else caller
    me = pwd.getpwuid(real_uid).pw_name
    owner = as_user or me
    really_root = caller is None and os.getuid() == 0 and os.geteuid() == 0
    if owner != me and not really_root:
        raise click.UsageError("only root may submit as another user")
    directory = Path(template_dir)
    try:
        # Read and loaded as the owner, as the daemon will at every relaunch: a directory the
        # owner cannot read, one that links outside itself, one another user may write, or one
        # that does not load within the loader's limits is refused now, not later.
        owner_ids = Owner.from_name(owner)
        drop = os.geteuid() == 0 and owner_ids.uid != 0
        template = load_template(
            directory,
            lambda path: read_template_bounded(owner_ids, path, drop_privileges=drop),
        )
        first = initial_revision(template)
        job_dir = work_dir or os.getcwd()
        _owner_directory(job_dir, owner_ids, drop=drop)
    except (TemplateError, OwnerReadRefused) as error:
        raise click.ClickException(str(error)) from error
    actor = repo.Actor.user(me, real_uid)
    job = Sbatch(first.script, owner, job_dir)
    with context.session() as session:
        started = submit_new_lineage(
            session,
            context.slurm(),
            job,
            name=template.name,
            template_dir=str(directory),
            knobs=knobs_to_json(first.knobs),
            actor=actor,
        )
    lineage_id, outcome = started.lineage_id, started.outcome
    refused = outcome.error
    if refused is not None:
        raise context.fail(
            f"{refused}: {refused.stderr.strip()}", exit_code=EXIT_SUBMIT
        ) from refused
    job_id, token = outcome.job_id, outcome.intent.token
    document = {"lineage": lineage_id, "job": job_id, "token": token}
    line = f"lineage {lineage_id}: submitted job {job_id} as {printable(owner)} (token {token})"
    context.emit(document, say(lambda _: line))


def _owner_directory(path: str, owner: Owner, *, drop: bool) -> None:
    """The job's working directory must be a directory the owner can enter: asked with the
    owner's rights (`test -d` as them under root), so root's answer never leaks."""
    from daemon.process import CommandError, as_user_argv, run  # noqa: PLC0415
    from daemon.templates.model import TemplateError  # noqa: PLC0415

    argv = ["test", "-d", path, "-a", "-x", path]
    try:
        found = run(as_user_argv(owner.uid, owner.gid, argv) if drop else argv, timeout=10).ok
    except CommandError:
        found = False
    if not found:
        raise TemplateError(f"--work-dir {path} is not a directory {owner.name} can enter")
