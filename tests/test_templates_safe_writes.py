"""Root's template commands never write where a user can steer them (issue 23): no file is
written through a link planted at any name, and under a directory a user could change the
write is made as that user, or refused. These run as root, with the local users alice and bob.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon.cli import main
from daemon.templates.model import parse_knob_text
from daemon.templates.reading import load_template
from daemon.templates.revisions import KnobChange, Patch, RevisionDir, apply_patch
from daemon.templates.safe_files import WriteRefused, make_dirs, write_file, writer_of

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

DATA = Path(__file__).resolve().parent / "data" / "sbatch"
KNOB = "per_device_train_batch_size"
UNTOUCHED = "root's own file: nobody may write here\n"


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def _user(name: str) -> pwd.struct_passwd:
    """An account of the module's `users` mark, looked up when used."""
    return pwd.getpwnam(name)


@pytest.fixture
def alice() -> pwd.struct_passwd:
    return _user("alice")


@pytest.fixture
def bob() -> pwd.struct_passwd:
    return _user("bob")


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A root-owned 0755 directory the users can traverse (pytest's tmp_path is root 0700)."""
    parent = Path(tempfile.mkdtemp(prefix="safe-writes-", dir="/tmp"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent)


def _owned_by(path: Path, user: pwd.struct_passwd, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chown(path, user.pw_uid, user.pw_gid)
    path.chmod(mode)
    return path


def _outside(directory: Path) -> Path:
    """A file only root may write, that a planted link points at."""
    target = directory / "outside.txt"
    target.write_text(UNTOUCHED)
    target.chmod(0o600)
    return target


def _imported(into: Path) -> Path:
    code, output = _invoke(
        "template", "import", str(DATA / "hf_run_clm.sbatch"),
        "--dialect", "hf", "--name", "clm", "--into", str(into),
    )  # fmt: skip
    assert code == 0, output
    return into / "clm"


def _next_id(directory: Path, value: str = "8") -> str:
    """The id `template set DIR KNOB=value` will give its revision (ids are content hashes)."""
    template = load_template(directory)
    head = RevisionDir(template).head()
    change = KnobChange(KNOB, head.knobs[KNOB], parse_knob_text(template.dialect, KNOB, value))
    return apply_patch(template, head, Patch((change,), "r")).id


def _set(directory: Path, value: str = "8") -> tuple[int, str]:
    return _invoke("template", "set", str(directory), f"{KNOB}={value}", "--reason", "OOM")


# ---------------------------------------------------------------- template set as root


def test_set_never_writes_through_a_link_at_the_old_temporary_name(tmp_path: Path) -> None:
    directory = _imported(tmp_path)
    outside = _outside(tmp_path)
    revision_id = _next_id(directory)
    planted = directory / "revisions" / f"{revision_id}.tmp"  # the name the old code wrote
    planted.symlink_to(outside)
    code, output = _set(directory)
    assert code == 0, output
    assert outside.read_text() == UNTOUCHED
    written = directory / "revisions" / f"{revision_id}.json"
    assert not written.is_symlink()
    assert json.loads(written.read_text())["id"] == revision_id
    assert planted.is_symlink()  # left as it was: never opened, never replaced
    leftovers = [p.name for p in (directory / "revisions").iterdir() if ".slurm-medic-" in p.name]
    assert leftovers == []


def test_a_link_at_the_revisions_own_name_is_refused_and_followed_nowhere(tmp_path: Path) -> None:
    directory = _imported(tmp_path)
    outside = _outside(tmp_path)
    revision_id = _next_id(directory)
    (directory / "revisions" / f"{revision_id}.json").symlink_to(outside)
    code, output = _set(directory)
    assert code == 1
    assert output.startswith("Error: cannot read ")
    assert "Traceback" not in output
    assert outside.read_text() == UNTOUCHED


def test_a_revision_read_through_a_link_is_refused_not_printed(tmp_path: Path) -> None:
    directory = _imported(tmp_path)
    outside = _outside(tmp_path)
    (directory / "revisions" / "dead0000.json").symlink_to(outside)
    code, output = _invoke("template", "render", str(directory), "--rev", "dead")
    assert code == 1
    assert "cannot read" in output
    assert UNTOUCHED.strip() not in output


def test_set_in_a_revisions_directory_of_alices_writes_as_alice(
    alice: pwd.struct_passwd, public_tmp: Path
) -> None:
    """A root-owned template whose `revisions/` alice may change: her link at the old name
    leads root nowhere, and the revision is written with her rights, as hers."""
    directory = _imported(public_tmp)
    revisions = directory / "revisions"
    for path in [revisions, *revisions.iterdir()]:
        os.chown(path, alice.pw_uid, alice.pw_gid)
    outside = _outside(public_tmp)
    revision_id = _next_id(directory)
    (revisions / f"{revision_id}.tmp").symlink_to(outside)
    code, output = _set(directory)
    assert code == 0, output
    assert outside.read_text() == UNTOUCHED
    written = revisions / f"{revision_id}.json"
    assert not written.is_symlink()
    assert written.stat().st_uid == alice.pw_uid


def test_import_as_root_into_alices_directory_makes_her_files(
    alice: pwd.struct_passwd, public_tmp: Path
) -> None:
    home = _owned_by(public_tmp / "alice", alice)
    directory = _imported(home)
    files = [directory, *directory.rglob("*")]
    assert {path.stat().st_uid for path in files} == {alice.pw_uid}
    assert len(list((directory / "revisions").glob("*.json"))) == 1


# ---------------------------------------------------------------- the writes themselves


def test_a_link_planted_at_any_name_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fresh names are made with O_CREAT|O_EXCL|O_NOFOLLOW: a link already at one (to an
    existing file or to none) is a name taken, and the next name is tried."""
    outside = _outside(tmp_path)
    nowhere = tmp_path / "would-be-created"
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / ".slurm-medic-aaaa.tmp").symlink_to(outside)
    (directory / ".slurm-medic-bbbb.tmp").symlink_to(nowhere)
    names = iter(["aaaa", "bbbb", "cccc"])
    monkeypatch.setattr(secrets, "token_hex", lambda _n: next(names))
    write_file(directory / "file.json", b"new\n")
    assert (directory / "file.json").read_bytes() == b"new\n"
    assert outside.read_text() == UNTOUCHED
    assert not nowhere.exists()
    assert sorted(p.name for p in directory.iterdir()) == [
        ".slurm-medic-aaaa.tmp",
        ".slurm-medic-bbbb.tmp",
        "file.json",
    ]


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    target = tmp_path / "file.json"
    target.symlink_to(outside)
    write_file(target, b"new\n")
    assert not target.is_symlink()
    assert target.read_bytes() == b"new\n"
    assert outside.read_text() == UNTOUCHED


def test_a_link_alice_swapped_in_for_her_directory_takes_roots_write_nowhere(
    alice: pwd.struct_passwd, public_tmp: Path
) -> None:
    home = _owned_by(public_tmp / "alice", alice)
    elsewhere = public_tmp / "etc-like"
    elsewhere.mkdir()
    (home / "revisions").symlink_to(elsewhere)
    os.lchown(home / "revisions", alice.pw_uid, alice.pw_gid)
    assert writer_of(home / "revisions") == alice.pw_uid
    with pytest.raises(WriteRefused, match=r"Permission denied \(as alice\)"):
        write_file(home / "revisions" / "x.json", b"{}")
    with pytest.raises(WriteRefused, match="Permission denied"):
        make_dirs(home / "revisions" / "sub")
    assert list(elsewhere.iterdir()) == []


def test_in_a_users_directory_root_writes_as_that_user(
    alice: pwd.struct_passwd, public_tmp: Path
) -> None:
    home = _owned_by(public_tmp / "alice", alice)
    make_dirs(home / "a" / "b")
    write_file(home / "a" / "b" / "file", b"x")
    for path in (home / "a", home / "a" / "b", home / "a" / "b" / "file"):
        assert path.stat().st_uid == alice.pw_uid
    roots = home / "roots"
    roots.mkdir()  # root's, inside alice's: hers to swap, not hers to write
    with pytest.raises(WriteRefused, match="Permission denied"):
        write_file(roots / "file", b"x")
    assert list(roots.iterdir()) == []


def test_two_users_who_could_steer_the_path_are_refused(
    alice: pwd.struct_passwd, bob: pwd.struct_passwd, public_tmp: Path
) -> None:
    home = _owned_by(public_tmp / "alice", alice, 0o777)
    shared = _owned_by(home / "bobs", bob)
    with pytest.raises(WriteRefused, match=r"more than one user \(alice, bob\)"):
        write_file(shared / "file", b"x")
    assert list(shared.iterdir()) == []


def test_a_root_directory_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(WriteRefused, match="others may write in it"):
        write_file(open_dir / "file", b"x")
    assert list(open_dir.iterdir()) == []
    open_dir.chmod(0o1777)  # like /tmp: each may change only their own entries
    write_file(open_dir / "file", b"x")
    assert (open_dir / "file").read_bytes() == b"x"


def test_what_cannot_be_written_is_one_clear_refusal(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(WriteRefused, match="'plain' is not a directory"):
        write_file(tmp_path / "plain" / "file", b"x")
    with pytest.raises(WriteRefused, match="does not exist"):
        write_file(tmp_path / "missing" / "file", b"x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(WriteRefused, match="more than 40 links"):
        write_file(tmp_path / "loop" / "file", b"x")
