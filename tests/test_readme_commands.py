"""The README's "Tools that work without the daemon" block, run as written: each line that
needs no cluster, parsed from README.md at test time, by the installed `slurm-medic`, on the
example files the checkout ships (`launch_templates/examples/`), in a copy of them so nothing is
written into the checkout. Each must exit 0 and print what the README says it prints, so the
README cannot drift from the program."""

from __future__ import annotations

import json
import shlex
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.store.schema import head_revision

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLES = ROOT / "launch_templates" / "examples"
MEDIC = Path(sys.executable).with_name("slurm-medic")
BLOCK_INTRO = "Tools that work without the daemon"
# The keys the README says `diagnose --json` prints ("`diagnose --json` prints one object: ...").
DIAGNOSIS_KEYS = (
    "kind", "onset", "confidence", "reasons", "root_cause", "root_cause_line", "rank", "node",
    "step", "phase", "oom",
)  # fmt: skip
OOM_KEYS = (
    "requested_bytes", "total_bytes", "free_bytes", "allocated_bytes",
    "reserved_unallocated_bytes", "process_in_use_bytes", "allowed_bytes", "other_processes",
)  # fmt: skip


@dataclass(frozen=True)
class Ran:
    """One README line's run: where it ran, the record its config names, what it printed."""

    cwd: Path
    record: Path
    returncode: int
    stdout: bytes
    stderr: str


def _diagnosed(ran: Ran) -> None:
    document = json.loads(ran.stdout)
    assert set(DIAGNOSIS_KEYS) <= document.keys()
    assert set(OOM_KEYS) <= document["oom"].keys()
    # The example's failure, as its note says: rank 1 on gpu-02 ran out of GPU memory.
    assert (document["root_cause"], document["rank"], document["node"]) == ("cuda_oom", 1, "gpu-02")
    assert document["kind"] == "fragmentation"  # 4.84 GiB stranded >= the 3.00 GiB asked for


def _analysed(ran: Ran) -> None:
    text = ran.stdout.decode()
    assert "  micro_batch = 4\n" in text  # each knob with its value and the line it comes from
    assert "      written train.sbatch:4: #SBATCH --nodes=2\n" in text
    assert "--checkpoint-dir" in text  # the script's checkpoint is its job id's: asked for
    assert text.splitlines()[-1].startswith("verdict: ")


def _imported(ran: Ran) -> None:
    directory = ran.cwd / "templates" / "clm"
    # "keeps your script byte for byte as templates/clm/job.sbatch ... and a template.toml"
    assert (directory / "job.sbatch").read_bytes() == (ran.cwd / "train.sbatch").read_bytes()
    assert 'dialect = "hf"' in (directory / "template.toml").read_text()
    text = ran.stdout.decode()
    assert "  per_device_train_batch_size" in text  # each knob of the template
    assert text.splitlines()[-1].startswith("verdict: ")


def _shown(ran: Ran) -> None:
    lines = ran.stdout.decode().splitlines()
    assert lines[0] == "clm  (Hugging Face Trainer) (imported: the script is kept as written)"
    assert "revisions: 1" in lines


def _rendered(ran: Ran) -> None:
    assert ran.stdout == (ran.cwd / "train.sbatch").read_bytes()  # "prints your script unchanged"


def _upgraded(ran: Ran) -> None:
    assert ran.stdout.decode() == f"record schema: empty -> {head_revision()}\n"
    with sqlite3.connect(f"file:{ran.record}?mode=ro", uri=True) as connection:
        [(version,)] = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    assert version == head_revision()


# Every line of the block, comments stripped: run here (with what must hold of it) ...
RUN: dict[str, Callable[[Ran], None] | None] = {
    "cd launch_templates/examples": None,
    "slurm-medic diagnose --log job-1234.out --json": _diagnosed,
    "slurm-medic template analyse train.sbatch": _analysed,
    "slurm-medic template import train.sbatch --dialect hf --name clm --into templates": _imported,
    "slurm-medic template show templates/clm": _shown,
    "slurm-medic template render templates/clm": _rendered,
    "slurm-medic db upgrade": _upgraded,
}
# ... or not, because it asks Slurm or a node.
NEEDS_CLUSTER = (
    "slurm-medic diagnose 1234",
    "slurm-medic probe gpu-03 --json",
)


def offline_block(readme: str) -> list[str]:
    """The block's lines, each as shell words would read it back, its `# comment` dropped."""
    lines = readme.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(BLOCK_INTRO))
    opening = next(index for index in range(start, len(lines)) if lines[index] == "```")
    closing = lines.index("```", opening + 1)
    return [shlex.join(shlex.split(line, comments=True)) for line in lines[opening + 1 : closing]]


def test_every_line_of_the_block_is_run_or_named_as_needing_the_cluster() -> None:
    block = offline_block(README.read_text(encoding="utf-8"))
    unaccounted = [line for line in block if line not in RUN and line not in NEEDS_CLUSTER]
    assert unaccounted == [], "a new README line: run it here, or name it in NEEDS_CLUSTER"
    stale = [line for line in (*RUN, *NEEDS_CLUSTER) if line not in block]
    assert stale == [], "lines the README no longer has"


def test_the_block_is_read_as_a_person_copies_it() -> None:
    text = (
        "x\nTools that work without the daemon, to try:\n\n"
        "```\ncd a  # go\nslurm-medic x 'a b' #c\n```\nslurm-medic after\n"
    )
    assert offline_block(text) == ["cd a", "slurm-medic x 'a b'"]


def test_the_offline_lines_run_as_written_on_the_shipped_examples(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    shipped = sorted(path.name for path in EXAMPLES.iterdir())
    # A person who tried the block in the checkout has a `templates` there: not shipped.
    shutil.copytree(
        EXAMPLES,
        checkout / "launch_templates" / "examples",
        ignore=shutil.ignore_patterns("templates"),
    )
    record = tmp_path / "medic.db"
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\nurl = "sqlite+pysqlite:///{record}"\n')
    # Root itself, with the record named by a config of the test's own.
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "SLURM_MEDIC_CONFIG": str(config)}
    cwd = checkout
    ran_lines = []
    for line in offline_block(README.read_text(encoding="utf-8")):
        if line in NEEDS_CLUSTER:
            continue
        argv = shlex.split(line)
        if argv[0] == "cd":
            cwd = (cwd / argv[1]).resolve()
            assert cwd.is_dir(), line
            continue
        assert argv[0] == "slurm-medic", line
        done = subprocess.run(
            [str(MEDIC), *argv[1:]], cwd=cwd, env=env, capture_output=True, check=False
        )
        ran = Ran(cwd, record, done.returncode, done.stdout, done.stderr.decode(errors="replace"))
        assert ran.returncode == 0, f"{line}: exit {ran.returncode}: {ran.stderr}"
        check = RUN[line]
        assert check is not None
        check(ran)
        ran_lines.append(line)
    assert ran_lines == [line for line, check in RUN.items() if check is not None]
    assert sorted(path.name for path in EXAMPLES.iterdir()) == shipped  # the checkout untouched
