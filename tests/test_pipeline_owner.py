"""The pipeline's log reader with the real owner-rights reader, as root for user alice: a log
she may read is scanned; a symlink to a file she may not read is a refusal on the record,
never its content."""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.gather import OwnerJobFiles, read_log_findings
from tests.test_pipeline import failed_job

pytestmark = [
    pytest.mark.cluster,  # the cluster's bring-up makes the job user alice
    pytest.mark.usefixtures("devcluster"),
]

USER = "alice"
OOM_LINE = (
    "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.54 GiB. GPU 3 has "
    "a total capacity of 79.19 GiB of which 557.62 MiB is free. Including non-PyTorch memory, "
    "this process has 78.64 GiB memory in use. Of the allocated memory 64.73 GiB is allocated "
    "by PyTorch, and 13.42 GiB is reserved by PyTorch but unallocated.\n"
)


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(f"/tmp/medic-owner-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    shutil.chown(path, USER, USER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_readable_log_is_scanned_as_its_owner(home: Path) -> None:
    log = home / "job.out"
    log.write_text("step 3/12 | loss 2.1\n" + OOM_LINE)
    shutil.chown(log, USER, USER)
    # uid None as 22.05's sacct JSON gives it: the owner is found by name.
    job = dataclasses.replace(failed_job(9001), uid=None, stdout_path=str(log))
    findings = read_log_findings(job, OwnerJobFiles(), 1024 * 1024)
    assert findings.oom is not None
    assert findings.oom.requested_bytes is not None
    assert findings.notes == ()


def test_a_symlink_to_a_file_the_owner_cannot_read_is_refused(home: Path) -> None:
    secret = home / "root-only"
    secret.write_text(OOM_LINE)
    secret.chmod(0o600)  # root's file: alice may not read it
    link = home / "job.out"
    link.symlink_to(secret)
    job = dataclasses.replace(failed_job(9002), uid=None, stdout_path=str(link))
    findings = read_log_findings(job, OwnerJobFiles(), 1024 * 1024)
    assert findings.oom is None
    assert len(findings.notes) == 1
    assert "not read as alice" in findings.notes[0]
    assert "13.42 GiB" not in findings.notes[0]


def test_the_sites_step_pattern_reaches_the_owners_scan(home: Path) -> None:
    log = home / "job.out"
    log.write_text("train| it 41/900 loss 2.1\ntrain| it 42/900 loss 2.0\n" + OOM_LINE)
    shutil.chown(log, USER, USER)
    job = dataclasses.replace(failed_job(9003), uid=None, stdout_path=str(log))
    built_in = read_log_findings(job, OwnerJobFiles(), 1024 * 1024)
    configured = read_log_findings(
        job, OwnerJobFiles(step_pattern=r"train\| it (\d+)/"), 1024 * 1024
    )
    assert built_in.max_step_seen is None  # no format the scanner knows
    assert configured.max_step_seen == 42
