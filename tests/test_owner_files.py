"""Reading as the job's owner, on the real kernel: a child that became alice reads what alice may.

These run as root (the daemon's case) with the local user `alice` (made by the dev cluster's
bring-up or by hand: `useradd -m alice`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.evidence.records import OomFamily
from daemon.owner_files import Owner, OwnerFiles, OwnerReadRefused
from daemon.owner_serve import answer
from daemon.owner_walk import RefusalKind

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

DATA = Path(__file__).parent / "data" / "logs"
SECRET = b"root-only: the owner must never see this line\n"


def alice_owner() -> Owner:
    """The local user alice, read as by root (the module's `users` mark makes her)."""
    entry = pwd.getpwnam("alice")
    return Owner(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid)


@contextmanager
def owned_dir(owner: Owner) -> Iterator[Path]:
    """A directory the owner owns, under a parent she can traverse (tmp_path is root 0700)."""
    parent = Path(tempfile.mkdtemp(prefix="owner-files-", dir="/tmp"))
    parent.chmod(0o755)
    home = parent / owner.name
    home.mkdir()
    os.chown(home, owner.uid, owner.gid)
    try:
        yield home
    finally:
        shutil.rmtree(parent)


@pytest.fixture
def alice() -> Owner:
    return alice_owner()


@pytest.fixture
def alice_dir(alice: Owner) -> Iterator[Path]:
    with owned_dir(alice) as home:
        yield home


def _root_only(directory: Path) -> Path:
    secret = directory.parent / "secret.log"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def _as_alice(path: Path, alice: Owner, data: bytes) -> Path:
    path.write_bytes(data)
    os.chown(path, alice.uid, alice.gid)
    path.chmod(0o600)
    return path


def test_symlink_to_a_root_only_file_is_refused_never_read(alice: Owner, alice_dir: Path) -> None:
    """The link leaves alice's tree (the log's directory): refused before the kernel is asked."""
    link = alice_dir / "train.log"
    link.symlink_to(_root_only(alice_dir))
    files = OwnerFiles(alice)
    for read in (lambda: files.read_tail(str(link), 4096), lambda: files.scan_log(str(link))):
        with pytest.raises(OwnerReadRefused) as refused:
            read()
        assert refused.value.refusal.kind is RefusalKind.SYMLINK
        assert refused.value.refusal.owner == "alice"
        assert "leaving" in refused.value.refusal.reason
        assert "root-only" not in str(refused.value)


def test_a_link_inside_the_tree_to_a_root_only_file_is_denied_by_the_kernel(
    alice: Owner, alice_dir: Path
) -> None:
    secret = alice_dir / "secret.log"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)  # root's, inside alice's directory: the walk allows it, the kernel not
    link = alice_dir / "train.log"
    link.symlink_to("secret.log")
    with pytest.raises(OwnerReadRefused) as refused:
        OwnerFiles(alice).read_tail(str(link), 4096)
    assert refused.value.refusal.kind is RefusalKind.DENIED
    assert "root-only" not in str(refused.value)


def test_a_root_only_file_named_directly_is_refused(alice: Owner, alice_dir: Path) -> None:
    secret = _root_only(alice_dir)
    with pytest.raises(OwnerReadRefused) as refused:
        OwnerFiles(alice).read_tail(str(secret), 100)
    assert refused.value.refusal.kind is RefusalKind.DENIED


def test_the_owners_own_file_is_read(alice: Owner, alice_dir: Path) -> None:
    log = (DATA / "torchrun_multirank_backward_oom.log").read_bytes()
    path = _as_alice(alice_dir / "slurm-77.out", alice, log)
    files = OwnerFiles(alice)
    assert files.read_tail(str(path), 100) == log[-100:]
    assert files.read_tail(str(path), 10 * len(log)) == log
    findings = files.scan_log(str(path))
    assert findings.rank == 3
    assert findings.oom is not None
    assert findings.oom.family is OomFamily.TORCH_ALLOCATOR
    assert findings.bytes_scanned == len(log)


def test_an_odd_file_name_reaches_the_child_intact(alice: Owner, alice_dir: Path) -> None:
    path = _as_alice(alice_dir / "run\nname \u00fc\u202e'; rm -rf ~.out", alice, b"tail\n")
    assert OwnerFiles(alice).read_tail(str(path), 100) == b"tail\n"


def test_the_owners_symlink_to_her_own_file_is_followed(alice: Owner, alice_dir: Path) -> None:
    target = _as_alice(alice_dir / "real.log", alice, b"step 1\nstep 2\n")
    link = alice_dir / "latest.log"
    link.symlink_to(target)
    assert OwnerFiles(alice).read_tail(str(link), 7) == b"step 2\n"


def test_a_fifo_is_refused_without_hanging(alice: Owner, alice_dir: Path) -> None:
    fifo = alice_dir / "train.log"
    os.mkfifo(fifo)
    os.chown(fifo, alice.uid, alice.gid)
    files = OwnerFiles(alice, timeout_s=20)
    for read in (lambda: files.read_tail(str(fifo), 10), lambda: files.scan_log(str(fifo))):
        with pytest.raises(OwnerReadRefused) as refused:
            read()
        assert refused.value.refusal.kind is RefusalKind.NOT_REGULAR


def test_a_missing_log_is_a_refusal_that_says_so(alice: Owner, alice_dir: Path) -> None:
    with pytest.raises(OwnerReadRefused) as refused:
        OwnerFiles(alice).scan_log(str(alice_dir / "never-written.log"))
    assert refused.value.refusal.kind is RefusalKind.MISSING


def test_checkpoints_are_found_as_the_owner(alice: Owner, alice_dir: Path) -> None:
    root = alice_dir / "out"
    for step in (100, 200):
        checkpoint = root / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
        (checkpoint / "model.safetensors").write_bytes(b"weights")
    for path in [root, *root.rglob("*")]:
        os.chown(path, alice.uid, alice.gid)
    scan = OwnerFiles(alice).find_last_good(CheckpointSpec(CheckpointLayout.HF, str(root)))
    assert scan.found is not None
    assert scan.found.step == 200
    assert scan.found.path == root / "checkpoint-200"


def test_a_checkpoint_tree_the_owner_cannot_list_yields_no_checkpoint(
    alice: Owner, alice_dir: Path
) -> None:
    root = alice_dir.parent / "root-checkpoints"
    (root / "checkpoint-5").mkdir(parents=True)
    (root / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    (root / "checkpoint-5" / "model.safetensors").write_bytes(b"weights")
    root.chmod(0o700)
    link = alice_dir / "out"
    link.symlink_to(root)
    scan = OwnerFiles(alice).find_last_good(CheckpointSpec(CheckpointLayout.HF, str(link)))
    assert scan.found is None
    assert "Permission denied" in scan.reason
    assert not scan.skipped


def test_reading_in_process_as_someone_else_refuses_a_final_symlink(
    alice: Owner, alice_dir: Path
) -> None:
    """Not dropping rights and not being the owner: a planted link is not followed."""
    target = _as_alice(alice_dir / "real.log", alice, b"hello\n")
    link = alice_dir / "train.log"
    link.symlink_to(target)
    files = OwnerFiles(alice, drop_privileges=False)
    with pytest.raises(OwnerReadRefused) as refused:
        files.read_tail(str(link), 10)
    assert refused.value.refusal.kind is RefusalKind.SYMLINK
    assert files.read_tail(str(target), 10) == b"hello\n"


def test_a_job_without_a_uid_is_never_read() -> None:
    with pytest.raises(OwnerReadRefused) as refused:
        Owner.for_job(user="ghost", uid=None)
    assert refused.value.refusal.kind is RefusalKind.NO_OWNER


def test_an_unknown_operation_is_refused(tmp_path: Path) -> None:
    reply = answer({"op": "delete", "path": str(tmp_path)}, as_owner=False)
    assert reply["refused"]["kind"] == RefusalKind.FAILED.value
