"""The gather stage: a job's files read with its owner's rights, its log's findings, its node
probed, and its lineage's template as the job ran it.

Handling an ended job (`pipeline`) and judging a relaunch (`verify`) both gather, so this
module is below both and imports neither: the stages import one way.
"""

from __future__ import annotations

import dataclasses
import logging
import pwd
from pathlib import Path
from typing import Protocol

from sqlalchemy.orm import Session

from daemon.checkpoints import CheckpointScan, CheckpointSpec
from daemon.evidence.findings import confine_to_allocation, merge_findings
from daemon.evidence.prober import NodeProber
from daemon.evidence.records import Evidence, LogFindings, NodeProbe
from daemon.owner_files import (
    Owner,
    OwnerFiles,
    OwnerReadRefused,
    TemplateTexts,
    job_tree,
)
from daemon.slurm.paths import PathContext, default_stdout_pattern, expand_std_path
from daemon.slurm.records import SlurmJob
from daemon.store import service_records as records
from daemon.store.models import Lineage, TemplateRevision
from daemon.templates.bounded import read_template_bounded
from daemon.templates.model import LaunchTemplate, TemplateError
from daemon.templates.reading import load_template
from daemon.templates.revisions import knobs_from_json
from remediators.allocator import current_option

log = logging.getLogger(__name__)


class JobFiles(Protocol):
    """A job's files, read with its owner's rights; a refusal raises `OwnerReadRefused`."""

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        """The scanner's findings over at most the last `max_bytes` of the log."""
        ...

    def find_last_good(self, job: SlurmJob, spec: CheckpointSpec) -> CheckpointScan: ...

    def read_template(self, owner: str, directory: str) -> TemplateTexts:
        """A lineage's template directory, read as the lineage's owner."""
        ...


class OwnerJobFiles:
    """The production `JobFiles`: `daemon.owner_files` reads as the owner (a child when root)."""

    def __init__(
        self, *, drop_privileges: bool | None = None, step_pattern: str | None = None
    ) -> None:
        self._drop = drop_privileges
        self._step_pattern = step_pattern  # the site's `step_pattern`: None = built-in formats

    def _files(self, job: SlurmJob) -> OwnerFiles:
        """22.05's sacct JSON may carry no uid: the user name then names the owner."""
        uid = job.uid
        if uid is None:
            try:
                uid = pwd.getpwnam(job.user).pw_uid
            except KeyError:
                uid = None
        return OwnerFiles(Owner.for_job(user=job.user, uid=uid), drop_privileges=self._drop)

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        """The owner's reader opens the log and scans it itself, as the CLI does, back at most
        `max_bytes` from its end (in its child, under its own memory and CPU limits, when
        root): a hostile line can cost that child, not us."""
        return self._files(job).scan_log(
            path,
            max_bytes=max_bytes,
            step_pattern=self._step_pattern,
            tree=job_tree(path, job.work_dir),
        )

    def find_last_good(self, job: SlurmJob, spec: CheckpointSpec) -> CheckpointScan:
        return self._files(job).find_last_good(spec)

    def read_template(self, owner: str, directory: str) -> TemplateTexts:
        """Read and loaded whole in a child with a deadline and a memory cap, as the owner
        (`templates.bounded`): a template that cannot load in time is refused, never a stalled
        cycle."""
        files = OwnerFiles(Owner.from_name(owner), drop_privileges=self._drop)
        return read_template_bounded(files.owner, directory, drop_privileges=files.drop_privileges)


def read_log_findings(job: SlurmJob, files: JobFiles, max_bytes: int) -> LogFindings:
    """The job's logs scanned from their ends with the owner's rights; refusals noted.

    The failing node is one of the job's own, or none: a node the log names outside the
    allocation is only a note (see `confine_to_allocation`), so nothing downstream (the
    probe, the diagnosis, a drain) can be pointed at another node by what a job prints.
    """
    paths = [path for path in dict.fromkeys((job.stdout_path, job.stderr_path)) if path]
    findings: list[LogFindings] = []
    notes: list[str] = []
    if not paths:
        notes.append("Slurm gave no output path for the job (accounting keeps none in 22.05)")
    for path in paths:
        try:
            findings.append(files.scan_log(job, path, max_bytes))
        except OwnerReadRefused as error:
            notes.append(str(error))
    merged = merge_findings(findings)
    merged = dataclasses.replace(merged, notes=merged.notes + tuple(notes))
    return confine_to_allocation(merged, job)


def gather(
    job: SlurmJob,
    *,
    files: JobFiles,
    prober: NodeProber | None,
    log_max_bytes: int,
    expandable_segments: bool | None = None,
) -> Evidence:
    """The Slurm record, the log scan and a probe of the failing rank's node; whether the run
    already had expandable segments (from its lineage's template) goes with them."""
    findings = read_log_findings(job, files, log_max_bytes)
    node = findings.node or (job.nodes[0] if len(job.nodes) == 1 else job.batch_host)
    probe: NodeProbe | None = None
    if prober is not None and node:
        try:
            probe = prober.probe(node, start=job.start_time, end=job.end_time)
        except ValueError as error:
            log.warning("probe of %r refused: %s", node, error)
    return Evidence(log=findings, job=job, probe=probe, expandable_segments=expandable_segments)


def lineage_template(
    lineage: Lineage, revision: TemplateRevision, files: JobFiles
) -> LaunchTemplate:
    """The lineage's template as the revision had it (its directory, read as the lineage's
    owner, and the revision's knobs)."""
    template = load_template(
        Path(lineage.template),
        lambda directory: files.read_template(lineage.owner, directory),
    )
    knobs = knobs_from_json(template.dialect, revision.knobs)
    return dataclasses.replace(template, knobs=knobs)


def lineage_expandable_segments(
    session: Session, submission: records.LineageSubmission, files: JobFiles
) -> bool | None:
    """Whether the revision the job ran had `expandable_segments` on in its template's env
    (None: not known). With it on, the diagnosis reads stranded bytes as a full card."""
    lineage = session.get(Lineage, submission.lineage_id)
    revision = session.get(TemplateRevision, submission.revision_id)
    if lineage is None or revision is None:
        return None
    try:
        return template_expandable_segments(lineage_template(lineage, revision, files))
    except TemplateError:
        return None


def template_expandable_segments(template: LaunchTemplate) -> bool | None:
    """The template's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF `expandable_segments`."""
    value = current_option(template, "expandable_segments")
    return None if value is None else value.lower() == "true"


def with_template_paths(
    session: Session, job: SlurmJob, submission: records.LineageSubmission, files: JobFiles
) -> SlurmJob:
    """22.05 accounting keeps no std paths and slurmctld forgets them MinJobAge after the
    end; a lineage job's paths are known anyway: its revision's sbatch options, expanded as
    slurmd expands them."""
    if job.stdout_path is not None:
        return job
    lineage = session.get(Lineage, submission.lineage_id)
    revision = session.get(TemplateRevision, submission.revision_id)
    if lineage is None or revision is None:
        return job
    try:
        options = dict(lineage_template(lineage, revision, files).sbatch)
    except TemplateError:
        return job
    context = PathContext(
        job_id=job.job_id, name=job.name, user=job.user, first_node=job.batch_host
    )
    stdout = options.get("output", default_stdout_pattern(is_array=False))
    stderr = options.get("error")
    return dataclasses.replace(
        job,
        stdout_path=expand_std_path(stdout, context, work_dir=job.work_dir),
        stderr_path=expand_std_path(stderr, context, work_dir=job.work_dir) if stderr else None,
    )
