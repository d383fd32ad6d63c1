"""What a hostile user can put where the daemon reads (issue 10, point 2): each ends in a
`TemplateError` or a refusal on the record, in bounded time, never in root's content.

These run as root (the daemon's case) with the local user `alice`, like test_owner_files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from daemon.checkpoints import CheckpointLayout, CheckpointSpec
from daemon.config import Settings
from daemon.gather import OwnerJobFiles, read_log_findings
from daemon.owner_files import Owner, OwnerFiles, OwnerReadRefused, job_tree
from daemon.owner_serve import MAX_TEMPLATE_CONFIGS, MAX_TEMPLATE_FILE_BYTES
from daemon.owner_walk import RefusalKind
from daemon.pipeline import PipelineDeps, handle_ended_job
from daemon.store.models import AuditEvent, Lineage, LineageStatus
from daemon.templates.model import TemplateError
from daemon.templates.reading import TemplateReader, load_template
from daemon.templates.rendering import render
from tests.test_checkpoints import hf_checkpoint
from tests.test_owner_files import SECRET, alice_owner, owned_dir
from tests.test_pipeline import failed_job, start_lineage
from tests.test_pipeline_owner import OOM_LINE

# Runs as the cluster's job users (alice, bob): the `users` mark makes them.
pytestmark = pytest.mark.users

EXAMPLE = Path(__file__).resolve().parent.parent / "launch_templates" / "torchrun"


@pytest.fixture
def alice() -> Owner:
    return alice_owner()


@pytest.fixture
def alice_dir(alice: Owner) -> Iterator[Path]:
    with owned_dir(alice) as home:
        yield home


def _give(path: Path, owner: Owner) -> None:
    for item in [path, *path.rglob("*")]:
        os.lchown(item, owner.uid, owner.gid)


def _template(alice: Owner, alice_dir: Path) -> Path:
    directory = alice_dir / "tpl"
    shutil.copytree(EXAMPLE, directory)
    _give(directory, alice)
    return directory


def _root_only_file(alice_dir: Path, name: str = "shadow") -> Path:
    """A file only root may read, outside alice's directory (the /etc/shadow of this test)."""
    secret = alice_dir.parent / name
    secret.write_bytes(b"#!/bin/bash\necho " + SECRET)
    secret.chmod(0o600)
    return secret


def _readers(alice: Owner) -> dict[str, TemplateReader]:
    return {
        "as alice (setpriv child)": OwnerFiles(alice).read_template,
        "in-process, not alice": OwnerFiles(alice, drop_privileges=False).read_template,
        "the caller (root) as itself": OwnerFiles.as_caller().read_template,
    }


def _refused_template(directory: Path, read: TemplateReader, message: str) -> str:
    with pytest.raises(TemplateError, match=message) as refused:
        load_template(directory, read)
    text = str(refused.value)
    assert SECRET.decode().strip() not in text
    return text


def test_a_script_linked_to_a_root_only_file_is_refused_by_every_reader(
    alice: Owner, alice_dir: Path
) -> None:
    directory = _template(alice, alice_dir)
    script = directory / "job.sbatch.j2"
    script.unlink()
    script.symlink_to(_root_only_file(alice_dir))
    os.lchown(script, alice.uid, alice.gid)
    for read in _readers(alice).values():
        _refused_template(directory, read, "symlink")


def test_a_link_in_a_middle_component_is_refused_when_it_leaves_the_tree(
    alice: Owner, alice_dir: Path
) -> None:
    directory = _template(alice, alice_dir)
    root_only = alice_dir.parent / "root-only"
    root_only.mkdir(mode=0o700)
    shutil.copy(_root_only_file(alice_dir), root_only / "job.sbatch.j2")
    toml = directory / "template.toml"
    toml.write_text(toml.read_text().replace('"job.sbatch.j2"', '"sub/job.sbatch.j2"'))
    (directory / "sub").symlink_to(root_only)
    os.lchown(directory / "sub", alice.uid, alice.gid)
    for read in _readers(alice).values():
        _refused_template(directory, read, "symlink")


def test_a_middle_link_that_stays_inside_is_followed_only_in_the_owners_read(
    alice: Owner, alice_dir: Path
) -> None:
    directory = _template(alice, alice_dir)
    (directory / "real").mkdir()
    (directory / "job.sbatch.j2").rename(directory / "real" / "job.sbatch.j2")
    (directory / "sub").symlink_to("real")
    toml = directory / "template.toml"
    toml.write_text(toml.read_text().replace('"job.sbatch.j2"', '"sub/job.sbatch.j2"'))
    _give(directory, alice)
    as_alice = load_template(directory, OwnerFiles(alice).read_template)
    assert render(as_alice) == render(load_template(EXAMPLE))
    _refused_template(
        directory, OwnerFiles(alice, drop_privileges=False).read_template, "not the owner's"
    )


def test_a_link_on_the_way_to_the_tree_is_followed_only_if_root_or_the_reading_owner_owns_it(
    alice: Owner, alice_dir: Path
) -> None:
    _template(alice, alice_dir)
    link = alice_dir / "latest"
    link.symlink_to(alice_dir / "tpl")
    os.lchown(link, alice.uid, alice.gid)
    assert load_template(link, OwnerFiles(alice).read_template).name == "torchrun-example"
    _refused_template(
        link, OwnerFiles(alice, drop_privileges=False).read_template, "only root's links"
    )


@pytest.mark.parametrize("name", ["job.sbatch.j2", "template.toml"])
def test_dev_zero_and_a_fifo_are_refused_at_once(alice: Owner, alice_dir: Path, name: str) -> None:
    directory = _template(alice, alice_dir)
    target = directory / name
    target.unlink()
    target.symlink_to("/dev/zero")
    os.lchown(target, alice.uid, alice.gid)
    _refused_template(directory, OwnerFiles(alice, timeout_s=20).read_template, "symlink")
    target.unlink()
    os.mkfifo(target)
    os.chown(target, alice.uid, alice.gid)
    _refused_template(directory, OwnerFiles(alice, timeout_s=20).read_template, "not_regular")


@pytest.mark.parametrize("name", ["job.sbatch.j2", "template.toml"])
def test_an_oversized_file_is_refused_from_its_size(
    alice: Owner, alice_dir: Path, name: str
) -> None:
    directory = _template(alice, alice_dir)
    target = directory / name
    with target.open("ab") as handle:
        handle.write(b"# padding\n" * (MAX_TEMPLATE_FILE_BYTES // 10 + 1))
    text = _refused_template(directory, OwnerFiles(alice).read_template, "too_large")
    assert f"over the {MAX_TEMPLATE_FILE_BYTES}-byte cap" in text


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "for",
        ),
        ("{% include '/etc/shadow' %}", "include"),
        ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "macro"),
        ("{{ 2**100000 }}", r"\*\*"),
        ("{{ 'a'*10**9 }}", r"\*"),
    ],
)
def test_hostile_jinja_in_the_owners_script_is_a_template_error(
    alice: Owner, alice_dir: Path, body: str, named: str
) -> None:
    directory = _template(alice, alice_dir)
    script = directory / "job.sbatch.j2"
    text = script.read_text()
    script.write_text(text + body + "\n")
    line = len(text.splitlines()) + 1
    _refused_template(directory, OwnerFiles(alice).read_template, f"line {line}: .*{named}")


def test_a_root_only_script_link_is_a_template_error_on_the_record(
    alice: Owner, alice_dir: Path, db_session: Session
) -> None:
    """The daemon's own path: the lineage's template read as its owner, the refusal recorded."""
    directory = _template(alice, alice_dir)
    lineage_id = start_lineage(db_session, 9301)
    lineage = db_session.get(Lineage, lineage_id)
    assert lineage is not None
    lineage.template = str(directory)
    script = directory / "job.sbatch.j2"
    script.unlink()
    script.symlink_to(_root_only_file(alice_dir))
    log = alice_dir / "job.out"
    log.write_text("step 3/12\n" + OOM_LINE)
    os.chown(log, alice.uid, alice.gid)
    job = dataclasses.replace(
        failed_job(9301), uid=alice.uid, stdout_path=str(log), work_dir=str(alice_dir)
    )
    deps = PipelineDeps(settings=Settings(), prober=None, files=OwnerJobFiles())
    result = handle_ended_job(db_session, job, deps)
    assert result.outcome == "template_error"
    assert "symlink leaving" in result.detail
    assert lineage.status == LineageStatus.EXHAUSTED.value
    details = " ".join(str(event.details) for event in db_session.query(AuditEvent))
    assert "symlink leaving" in details
    assert SECRET.decode().strip() not in details


def test_a_log_behind_a_middle_link_dev_zero_or_a_fifo_is_a_note_not_a_read(
    alice: Owner, alice_dir: Path
) -> None:
    outside = alice_dir.parent / "root-logs"
    outside.mkdir(mode=0o700)
    (outside / "job.out").write_text(OOM_LINE)
    (alice_dir / "logs").symlink_to(outside)
    (alice_dir / "zero.out").symlink_to("/dev/zero")
    os.mkfifo(alice_dir / "fifo.out")
    _give(alice_dir, alice)
    cases = {
        "logs/job.out": RefusalKind.SYMLINK,
        "zero.out": RefusalKind.SYMLINK,
        "fifo.out": RefusalKind.NOT_REGULAR,
    }
    for name, kind in cases.items():
        job = dataclasses.replace(
            failed_job(9302),
            uid=alice.uid,
            stdout_path=str(alice_dir / name),
            work_dir=str(alice_dir),
        )
        findings = read_log_findings(job, OwnerJobFiles(), 1024 * 1024)
        assert findings.oom is None
        assert any(f"not read as alice: {kind}" in note for note in findings.notes), name


def test_the_owners_child_scans_only_the_last_max_bytes(alice: Owner, alice_dir: Path) -> None:
    log = alice_dir / "job.out"
    log.write_text(OOM_LINE + "step 7/12 | loss 2.0\n" * 20_000)
    os.chown(log, alice.uid, alice.gid)
    job = dataclasses.replace(
        failed_job(9303), uid=alice.uid, stdout_path=str(log), work_dir=str(alice_dir)
    )
    near_end = read_log_findings(job, OwnerJobFiles(), 64 * 1024)
    assert near_end.oom is None
    assert near_end.max_step_seen == 7
    assert 0 < near_end.bytes_scanned <= 64 * 1024
    whole = read_log_findings(job, OwnerJobFiles(), 1024 * 1024)
    assert whole.oom is not None


def test_a_checkpoint_file_that_would_exhaust_memory_is_skipped_unparsed(
    alice: Owner, alice_dir: Path
) -> None:
    """60 MB of `{},` would be over a GiB of Python objects: the reader counts the containers
    before it parses and skips the checkpoint with the reason, so the scan still answers."""
    checkpoint = alice_dir / "out" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    with (checkpoint / "trainer_state.json").open("wb") as handle:
        handle.write(b"[" + b"{}," * 20_000_000 + b"{}]")
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    _give(alice_dir / "out", alice)
    spec = CheckpointSpec(CheckpointLayout.HF, str(alice_dir / "out"))
    scan = OwnerFiles(alice, timeout_s=60).find_last_good(spec)
    assert scan.found is None
    assert [skip.reason for skip in scan.skipped] == [
        "trainer_state.json holds over 2000000 objects and arrays"
    ]


def test_a_scan_that_runs_away_is_a_timeout_of_the_child(alice: Owner, alice_dir: Path) -> None:
    """A pattern that backtracks exponentially on alice's lines burns the child's time only."""
    log = alice_dir / "job.out"
    log.write_text(("a" * 40 + "!\n") * 3)
    os.chown(log, alice.uid, alice.gid)
    with pytest.raises(OwnerReadRefused) as refused:
        OwnerFiles(alice, timeout_s=2).scan_log(str(log), step_pattern=r"(a+)+b(\d)")
    assert refused.value.refusal.kind is RefusalKind.TIMEOUT


# ------------------------------------------------- the same walk in-process (the CLI, any user)


def _own_template(tmp_path: Path) -> Path:
    directory = tmp_path / "tpl"
    shutil.copytree(EXAMPLE, directory)
    return directory


def _swap_for_link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _swap_for_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _pad(path: Path) -> None:
    with path.open("ab") as handle:
        handle.write(b"#" * MAX_TEMPLATE_FILE_BYTES)


def _middle_link(directory: Path) -> None:
    (directory / "sub").symlink_to(directory.parent)
    toml = directory / "template.toml"
    toml.write_text(toml.read_text().replace('"job.sbatch.j2"', '"sub/elsewhere"'))


@pytest.mark.parametrize(
    ("plant", "message"),
    [
        (lambda d: _swap_for_link(d / "job.sbatch.j2", d.parent / "elsewhere"), "symlink leaving"),
        (lambda d: _swap_for_link(d / "job.sbatch.j2", Path("/dev/zero")), "symlink leaving"),
        (lambda d: _swap_for_link(d / "template.toml", Path("/dev/zero")), "symlink leaving"),
        (lambda d: _swap_for_link(d / "job.sbatch.j2", Path("../elsewhere")), "climbs out"),
        (lambda d: _swap_for_fifo(d / "template.toml"), "not_regular"),
        (lambda d: _swap_for_fifo(d / "job.sbatch.j2"), "not_regular"),
        (lambda d: _pad(d / "job.sbatch.j2"), "too_large"),
        (_middle_link, "symlink leaving"),
    ],
    ids=[
        "link-out",
        "dev-zero",
        "toml-dev-zero",
        "relative-out",
        "toml-fifo",
        "fifo",
        "oversized",
        "middle",
    ],
)
def test_the_callers_own_read_walks_the_same_way(
    tmp_path: Path, plant: Callable[[Path], None], message: str
) -> None:
    directory = _own_template(tmp_path)
    (tmp_path / "elsewhere").write_text("#!/bin/bash\necho outside\n")
    plant(directory)
    with pytest.raises(TemplateError, match=message):
        load_template(directory)


def test_the_callers_links_inside_the_tree_are_followed(tmp_path: Path) -> None:
    directory = _own_template(tmp_path)
    (directory / "scripts").mkdir()
    (directory / "job.sbatch.j2").rename(directory / "scripts" / "real.j2")
    (directory / "job.sbatch.j2").symlink_to("scripts/../scripts/real.j2")
    assert render(load_template(directory)) == render(load_template(EXAMPLE))


def test_a_log_read_in_process_refuses_a_middle_link_out_of_the_tree(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "job.out").write_text("secret\n")
    work.mkdir()
    (work / "logs").symlink_to(tmp_path / "outside")
    files = OwnerFiles.as_caller()
    with pytest.raises(OwnerReadRefused) as refused:
        files.read_tail(
            str(work / "logs" / "job.out"),
            100,
            tree=job_tree(str(work / "logs" / "job.out"), str(work)),
        )
    assert refused.value.refusal.kind is RefusalKind.SYMLINK
    with pytest.raises(OwnerReadRefused) as named_outside:
        files.read_tail(str(tmp_path / "outside" / "job.out"), 100, tree=str(work))
    assert named_outside.value.refusal.kind is RefusalKind.OUTSIDE


def test_job_tree_is_the_work_dir_when_the_log_lies_in_it() -> None:
    assert job_tree("/home/a/run/logs/x.out", "/home/a/run") == "/home/a/run"
    assert job_tree("/scratch/a/x.out", "/home/a/run") == "/scratch/a"
    assert job_tree("/home/a/run2/x.out", "/home/a/run") == "/home/a/run2"
    assert job_tree("/x.out", None) == "/"


def test_checkpoints_read_through_the_walk_skip_what_leaves_or_loops(tmp_path: Path) -> None:
    root = tmp_path / "out"
    hf_checkpoint(root, 5)
    hf_checkpoint(tmp_path / "elsewhere", 900)
    (root / "checkpoint-900").symlink_to(tmp_path / "elsewhere" / "checkpoint-900")
    (root / "checkpoint-800").symlink_to(root / "checkpoint-800")
    (root / "checkpoint-700").mkdir()
    (root / "checkpoint-700" / "trainer_state.json").symlink_to("/etc/hostname")
    (root / "checkpoint-700" / "model.safetensors").write_text("w")
    (root / "checkpoint-650").symlink_to(root / "missing")
    hf_checkpoint(root / "real", 600)
    (root / "checkpoint-600").symlink_to("real/checkpoint-600")
    (root / "checkpoint-550").mkdir()
    os.mkfifo(root / "checkpoint-550" / "trainer_state.json")
    scan = OwnerFiles.as_caller().find_last_good(CheckpointSpec(CheckpointLayout.HF, str(root)))
    assert scan.found is not None
    assert scan.found.step == 600  # a link inside the root is the caller's own, followed
    assert scan.found.path == root / "real" / "checkpoint-600"
    reasons = {item.name: item.reason for item in scan.skipped}
    assert "symlink leaving" in reasons["'checkpoint-900'"]
    assert "symlink loop" in reasons["'checkpoint-800'"]
    assert "symlink leaving" in reasons["'checkpoint-700'"]
    assert "dangling symlink" in reasons["'checkpoint-650'"]


IMPORTED_TOML = """name = "ds"
dialect = "deepspeed"
script = "job.sbatch"
imported = true

[configs]
"ds_config.json" = "configs/ds_config.json"
"""
DS_SCRIPT = (
    "#!/bin/bash\n#SBATCH --nodes=1\nsrun deepspeed train.py --deepspeed_config ds_config.json\n"
)
DS_CONFIG = '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}\n'


def _imported_template(alice: Owner, alice_dir: Path) -> Path:
    directory = alice_dir / "imported"
    (directory / "configs").mkdir(parents=True)
    (directory / "template.toml").write_text(IMPORTED_TOML)
    (directory / "job.sbatch").write_text(DS_SCRIPT)
    (directory / "configs" / "ds_config.json").write_text(DS_CONFIG)
    _give(directory, alice)
    return directory


def test_a_kept_config_is_read_as_the_owner_with_the_script(alice: Owner, alice_dir: Path) -> None:
    directory = _imported_template(alice, alice_dir)
    texts = OwnerFiles(alice).read_template(str(directory))
    assert texts.configs == (("configs/ds_config.json", DS_CONFIG),)
    template = load_template(directory, OwnerFiles(alice).read_template)
    assert template.knobs["zero_stage"] == 2
    assert "zero_stage" not in template.not_managed


def test_a_kept_config_linked_out_of_the_tree_is_refused_by_every_reader(
    alice: Owner, alice_dir: Path
) -> None:
    directory = _imported_template(alice, alice_dir)
    config = directory / "configs" / "ds_config.json"
    config.unlink()
    config.symlink_to(_root_only_file(alice_dir))
    os.lchown(config, alice.uid, alice.gid)
    for read in _readers(alice).values():
        _refused_template(directory, read, "symlink")


def test_a_huge_or_binary_kept_config_is_refused(alice: Owner, alice_dir: Path) -> None:
    directory = _imported_template(alice, alice_dir)
    config = directory / "configs" / "ds_config.json"
    config.write_bytes(b" " * (MAX_TEMPLATE_FILE_BYTES + 1))
    _refused_template(directory, OwnerFiles(alice).read_template, "too_large")
    config.write_bytes(b'{"stage": 2}\0\n')
    _refused_template(directory, OwnerFiles(alice).read_template, "unusable: .* is binary")


def test_kept_configs_are_bounded_in_number_and_place(alice: Owner, alice_dir: Path) -> None:
    directory = _imported_template(alice, alice_dir)
    toml = directory / "template.toml"
    toml.write_text(IMPORTED_TOML.replace('"configs/ds_config.json"', '"../../shadow"'))
    _refused_template(directory, OwnerFiles(alice).read_template, "outside")
    many = "".join(
        f'"c{number}.json" = "configs/ds_config.json"\n'
        for number in range(MAX_TEMPLATE_CONFIGS + 1)
    )
    toml.write_text(IMPORTED_TOML + many)
    _refused_template(directory, OwnerFiles(alice).read_template, "more than")
