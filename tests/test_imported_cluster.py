"""An imported script through the whole loop on the real local cluster.

A researcher's own sbatch script, written the way people write them (values in shell
variables, a `${X:-default}`, the launch line piped into `tee`), is imported with
`slurm-medic template import`, submitted with `slurm-medic submit`, dies of fragmentation
(the real program: transformers' Trainer over gloo, the OOM injected), and the daemon relaunches
it with the allocator fix.
What the relaunch ran is the user's script with exactly two additions: the allocator export
after the #SBATCH header and the resume flag at the end of the training command's arguments,
before the pipe. Everything else, byte for byte, is what the user wrote.
"""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from daemon.cli import main
from daemon.config import load_settings
from daemon.slurm.backend import SlurmCli
from daemon.store.engine import make_session_factory
from daemon.store.models import Action, Incident, Proposal, TemplateRevision
from tests.devcluster import DevCluster
from tests.e2e import REAL_TRAIN
from tests.test_service_cluster import (
    USER,
    configure,
    cycle_until,
    daemon_for,
    proposals,
    submit,
    work_dir,
)

pytestmark = [pytest.mark.cluster]
__all__ = ["work_dir"]  # the fixture, shared with the service's cluster tests

SCRIPT = """#!/bin/bash
#SBATCH --job-name=imported-hf
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --time=00:30:00
#SBATCH --output={work}/%x-%j.out
# my fine-tune; values kept in variables, as in the lab's other scripts
set -euo pipefail

export EMULATION_SCENARIO=fragmentation
export EMULATION_STEP_SECONDS=0.3
export MAX_STEPS=40
export EMULATION_NCCL_TIMEOUT_SECONDS=3
OUTPUT_DIR={work}/ckpt
MICRO_BATCH=${{MICRO_BATCH:-4}}

srun {python} {program} \\
    --model_name_or_path gpt2 \\
    --output_dir "$OUTPUT_DIR" \\
    --save_strategy steps --save_steps 2 --logging_steps 1 \\
    --per_device_train_batch_size $MICRO_BATCH \\
    --gradient_accumulation_steps 8 \\
    --dataloader_num_workers 4 2>&1 | tee {work}/train-$SLURM_JOB_ID.log
echo "finished"
"""


def test_an_imported_script_is_relaunched_as_written_plus_the_fix(
    devcluster: DevCluster, work_dir: Path
) -> None:
    python, program = REAL_TRAIN
    script_text = SCRIPT.format(work=work_dir, python=python, program=program)
    script = work_dir / "finetune.sbatch"
    script.write_text(script_text)
    imported = CliRunner().invoke(
        main,
        [
            "template",
            "import",
            str(script),
            "--dialect",
            "hf",
            "--name",
            "imported-hf",
            "--into",
            str(work_dir / "templates"),
        ],
    )
    assert imported.exit_code == 0, imported.output
    assert "ready to manage" in imported.output
    template = work_dir / "templates" / "imported-hf"
    assert (template / "job.sbatch").read_bytes() == script.read_bytes()
    for path in [template, *template.iterdir()]:
        shutil.chown(path, USER, USER)
    rendered = CliRunner().invoke(main, ["template", "render", str(template)])
    assert rendered.exit_code == 0, rendered.output
    assert rendered.stdout_bytes == script.read_bytes()

    config = configure(work_dir, devcluster)
    daemon = daemon_for(load_settings(config))
    first_job = submit(template, config, work_dir)
    daemon.start()
    cycle_until(
        daemon,
        lambda: any(p.state == "verified" for p in proposals(daemon)),
        timeout_s=150,
    )
    with make_session_factory(daemon.engine)() as session:
        incident = session.scalars(select(Incident).where(Incident.slurm_job_id == first_job)).one()
        assert incident.kind == "fragmentation"
        proposal = session.scalars(select(Proposal)).one()
        assert proposal.remediator == "allocator_expandable_segments"
        revision = session.scalars(
            select(TemplateRevision).where(TemplateRevision.proposal_id == proposal.id)
        ).one()
        action = session.scalars(
            select(Action).where(Action.kind == "sbatch", Action.proposal_id == proposal.id)
        ).one()
        relaunched_script, relaunch_job = revision.rendered_script, action.slurm_job_id
    added = [
        line[1:]
        for line in difflib.ndiff(
            script_text.splitlines(keepends=True),
            relaunched_script.splitlines(keepends=True),
        )
        if line.startswith(("+ ", "- "))
    ]
    # One export line added, and the launch line's last argument line gains the resume flag
    # before the pipe; nothing else of the user's script moved.
    assert len(added) == 3, added
    assert added[0].strip() == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    removed, changed = added[1], added[2]
    assert removed.strip().startswith("--dataloader_num_workers 4 2>&1 | tee")
    head, pipe = changed.split(" 2>&1 | tee ", 1)
    assert head.strip().startswith("--dataloader_num_workers 4 --resume_from_checkpoint ")
    assert f"{work_dir}/ckpt/checkpoint-" in head
    assert removed.split(" 2>&1 | tee ", 1)[1] == pipe
    assert relaunch_job is not None
    log = Path(work_dir / f"imported-hf-{relaunch_job}.out").read_text()
    # transformers 5's Trainer's own words on resuming.
    assert "Resuming training from checkpoint with epoch 0 and global step 2" in log
    assert "OutOfMemoryError" not in log
    daemon.leader.release()
    SlurmCli().cancel(relaunch_job)  # verified; no need to run it out
