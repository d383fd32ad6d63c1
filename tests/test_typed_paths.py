"""Paths as a person types them (issue 24): every command takes a relative path from the
directory it was started in, by its text alone, and the reader opens it with the caller's
rights; under sudo `submit` reads as the person and the commands that need nothing of root
(`template`, `diagnose --log`) are refused. What was refused before (`..` climbing out of a
template, a file the caller may not read, a log that is a link) still is."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import click
import pytest
from click.testing import CliRunner, Result

from daemon.cli import main
from daemon.commands.paths import typed_path
from daemon.process import CommandResult, as_user_argv, run
from daemon.store.schema import head_revision

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "launch_templates" / "examples"
HF_TEMPLATE = ROOT / "launch_templates" / "hf-trainer"
DATA = Path(__file__).resolve().parent / "data" / "sbatch"
MEDIC = Path(sys.executable).with_name("slurm-medic")
ROOT_ITSELF = {"SUDO_UID": None, "SLURM_MEDIC_CONFIG": None}  # even if pytest ran under sudo


def invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env={**ROOT_ITSELF, **(env or {})})


def _alice() -> pwd.struct_passwd:
    """Looked up when a test runs: the `users` mark makes the account."""
    return pwd.getpwnam("alice")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A root-owned 0755 directory every user may traverse (pytest's tmp_path is root's 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="typed-paths-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _alices(path: Path) -> Path:
    """`path` and everything below it made alice's."""
    alice = _alice()
    for item in [path, *path.rglob("*")]:
        os.chown(item, alice.pw_uid, alice.pw_gid)
    return path


def _as_alice(cwd: Path, *args: str) -> CommandResult:
    """`slurm-medic ARGS` run by alice herself (no sudo), started in `cwd`."""
    alice = _alice()
    argv = as_user_argv(alice.pw_uid, alice.pw_gid, [str(MEDIC), *args])
    return run(argv, timeout=60, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=str(cwd))


# ---------------------------------------------------------------- every path parameter


def _commands(command: click.Command, name: str = "") -> Iterator[tuple[str, click.Command]]:
    yield name, command
    if isinstance(command, click.Group):
        context = click.Context(command)
        for sub in command.list_commands(context):
            found = command.get_command(context, sub)
            assert found is not None
            yield from _commands(found, f"{name} {sub}".strip())


# What each command's path parameters are; `template analyse`/`import` SCRIPT goes through
# `paths.absolute` in the command, which also shows it as typed.
PATH_PARAMETERS = {
    ("diagnose", "logs"),
    ("submit", "template_dir"),
    ("submit", "work_dir"),
    ("template analyse", "submit_dir"),
    ("template analyse", "checkpoint_dir"),
    ("template import", "into"),
    ("template import", "submit_dir"),
    ("template import", "checkpoint_dir"),
    ("template show", "directory"),
    ("template render", "directory"),
    ("template set", "directory"),
    ("template diff", "directory"),
    ("probe", "key_path"),
    ("probe", "known_hosts_path"),
    ("web", "socket_path"),
}


def test_every_path_parameter_is_taken_as_typed_and_looked_at_by_no_one_as_root() -> None:
    typed = set()
    for name, command in _commands(main):
        for param in command.params:
            if param.callback is typed_path:
                typed.add((name, param.name))
            # click's own look (exists, resolve_path) is this process's: root's under sudo.
            if isinstance(param.type, click.Path):
                assert not param.type.exists, (name, param.name)
                assert not param.type.resolve_path, (name, param.name)
            if param.name == "config_path":
                assert param.callback is typed_path, name
    assert typed >= PATH_PARAMETERS
    assert {name for name, parameter in typed if parameter == "config_path"} >= {
        "db upgrade", "db current", "run", "web", "submit", "diagnose", "status", "approve",
    }  # fmt: skip


# ---------------------------------------------------------------- as root (or as oneself)


def test_the_readmes_import_and_the_default_into_work_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's failure: `--into templates` (and its default) were read back as a relative
    path the reader refuses ("'templates/clm' is not an absolute path")."""
    shutil.copy(EXAMPLES / "train.sbatch", tmp_path / "train.sbatch")
    monkeypatch.chdir(tmp_path)
    into = ("--dialect", "hf", "--name", "clm", "--into", "templates")
    imported = invoke("template", "import", "train.sbatch", *into)
    assert imported.exit_code == 0, imported.output
    shown = invoke("template", "show", "templates/clm", "--json")
    assert shown.exit_code == 0, shown.output
    [first] = json.loads(shown.output)["revisions"]
    rendered = invoke("template", "render", "templates/clm")
    assert rendered.stdout_bytes == (tmp_path / "train.sbatch").read_bytes()
    changed = invoke(
        "template", "set", "templates/clm", "per_device_train_batch_size=2", "--reason", "OOM"
    )
    assert changed.exit_code == 0, changed.output
    second = changed.output.split()[1]
    diff = invoke("template", "diff", "templates/clm", first["id"], second)
    assert diff.exit_code == 0, diff.output
    assert "+    --per_device_train_batch_size 2 \\\n" in diff.output
    assert (tmp_path / "templates" / "clm" / "revisions" / f"{second}.json").is_file()

    monkeypatch.chdir(tmp_path / "templates")
    assert invoke("template", "show", "clm").exit_code == 0  # named from where one stands
    assert invoke("template", "show", "../templates/clm").exit_code == 0  # `..` as a shell's cd
    monkeypatch.chdir(tmp_path)
    default = invoke("template", "import", "train.sbatch", "--dialect", "hf", "--name", "other")
    assert default.exit_code == 0, default.output
    assert (tmp_path / "templates" / "other" / "job.sbatch").is_file()  # INTO's default


def test_analyse_takes_the_script_submit_dir_and_checkpoint_dir_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "run").mkdir()
    shutil.copy(DATA / "deepspeed_zero.sbatch", tmp_path / "scripts" / "job.sbatch")
    shutil.copy(DATA / "ds_config.json", tmp_path / "run" / "ds_config.json")
    monkeypatch.chdir(tmp_path)
    result = invoke(
        "template", "analyse", "scripts/job.sbatch", "--json",
        "--submit-dir", "run", "--checkpoint-dir", "ckpt",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["script"] == "scripts/job.sbatch"  # shown as typed
    assert document["submit_dir"] == str(tmp_path / "run")
    [config] = document["files"]
    assert (config["location"], config["state"]) == (str(tmp_path / "run/ds_config.json"), "read")
    assert document["checkpoint"]["directory"] == str(tmp_path / "ckpt")
    imported = invoke(
        "template", "import", "scripts/job.sbatch", "--dialect", "deepspeed", "--name", "ds",
        "--submit-dir", "run", "--checkpoint-dir", "ckpt",
    )  # fmt: skip
    assert imported.exit_code == 0, imported.output
    toml = (tmp_path / "templates" / "ds" / "template.toml").read_text()
    assert f'checkpoint_dir = "{tmp_path / "ckpt"}"' in toml
    assert (tmp_path / "templates" / "ds" / "configs" / "ds_config.json").is_file()


def test_what_was_refused_inside_a_template_is_refused_when_it_is_named_relatively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(HF_TEMPLATE, tmp_path / "tpl")
    (tmp_path / "outside.j2").write_text("#!/bin/bash\necho outside\n")
    toml = tmp_path / "tpl" / "template.toml"
    toml.write_text(toml.read_text().replace('"job.sbatch.j2"', '"../outside.j2"'))
    monkeypatch.chdir(tmp_path)
    shown = invoke("template", "show", "tpl")
    assert shown.exit_code == 1
    assert "outside: script '../outside.j2' must be a file inside" in shown.output
    shutil.copy(EXAMPLES / "train.sbatch", tmp_path / "train.sbatch")
    escape = invoke("template", "import", "train.sbatch", "--dialect", "hf", "--name", "../x")
    assert escape.exit_code == 2
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "templates").exists()


def test_a_path_that_cannot_be_made_absolute_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    for args in (("template", "show", "tpl"), ("template", "analyse", "job.sbatch")):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert "'tpl'" in result.output or "'job.sbatch'" in result.output
        assert "is relative, and the current directory is gone" in result.output
    monkeypatch.chdir(tmp_path)
    empty = invoke("template", "show", "")
    assert empty.exit_code == 2
    assert "an empty path" in empty.output


def test_diagnose_reads_a_relative_log_and_still_refuses_one_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copy(EXAMPLES / "job-1234.out", tmp_path / "job-1234.out")
    (tmp_path / "link.out").symlink_to("job-1234.out")
    monkeypatch.chdir(tmp_path)
    result = invoke("diagnose", "--log", "job-1234.out", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["node"] == "gpu-02"
    linked = invoke("diagnose", "--log", "link.out")
    assert linked.exit_code == 3
    assert f"{tmp_path / 'link.out'} is a symlink" in linked.output


def test_the_record_named_relatively_by_config_or_url_is_the_current_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("config.toml").write_text('[store]\nurl = "sqlite+pysqlite:///by-config.db"\n')
    upgraded = invoke("db", "upgrade", "--config", "config.toml")
    assert upgraded.exit_code == 0, upgraded.output
    assert (tmp_path / "by-config.db").is_file()
    by_url = invoke("db", "upgrade", "--database", "sqlite+pysqlite:///by-url.db")
    assert by_url.exit_code == 0, by_url.output
    current = invoke("db", "current", "--database", "sqlite+pysqlite:///by-url.db")
    assert current.output.splitlines()[0] == f"current: {head_revision()}"
    missing = invoke("db", "current", "--config", "nothing.toml")
    assert missing.exit_code == 1
    assert f"config file {tmp_path / 'nothing.toml'} does not exist" in missing.output


def test_the_operators_files_are_named_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    probe = invoke("probe", "gpu-01", "--key", "keys/medic", "--known-hosts", "known_hosts")
    assert probe.exit_code == 2
    assert f"SSH key {tmp_path / 'keys/medic'} is not a readable file" in probe.output
    asked: list[object] = []

    def load(*_: object, overrides: dict[str, object], **__: object) -> None:
        asked.append(overrides)
        raise click.ClickException("stopped before serving")

    monkeypatch.setattr("daemon.commands.web.CommandContext.load", load)
    assert invoke("web", "--socket", "run/web.sock").exit_code == 1
    assert asked == [{"web": {"socket": str(tmp_path / "run/web.sock")}}]


class RecordingSlurm:
    """The Slurm seam of `submit`: sbatch answers a job id and says where it ran."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, str | None]] = []

    def submit(self, script: str, *, as_user: str, work_dir: str | None = None, **_: object) -> int:
        self.submitted.append((as_user, work_dir))
        return 7000 + len(self.submitted)


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> RecordingSlurm:
    recording = RecordingSlurm()
    monkeypatch.setattr("daemon.commands.context.SlurmCli", lambda **_: recording)
    return recording


def _record(directory: Path) -> tuple[Path, Path]:
    """A record at this code's schema, and a config naming it."""
    record = directory / "medic.db"
    config = directory / "config.toml"
    config.write_text(f'[store]\nurl = "sqlite+pysqlite:///{record}"\n')
    assert invoke("db", "upgrade", "--config", str(config)).exit_code == 0
    return record, config


def _lineages(record: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(f"file:{record}?mode=ro", uri=True) as connection:
        return connection.execute("SELECT owner, template FROM lineage").fetchall()


def test_submit_takes_the_template_and_the_work_dir_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm: RecordingSlurm
) -> None:
    record, _ = _record(tmp_path)
    shutil.copytree(HF_TEMPLATE, tmp_path / "tpl")
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path)
    config = ("--config", "config.toml")
    submitted = invoke("submit", "tpl", "--work-dir", "run", *config, "--json")
    assert submitted.exit_code == 0, submitted.output
    assert invoke("submit", "tpl", *config).exit_code == 0  # --work-dir's default: here
    me = pwd.getpwuid(os.getuid()).pw_name  # root itself, as the suite runs
    assert slurm.submitted == [(me, str(tmp_path / "run")), (me, str(tmp_path))]
    assert _lineages(record) == [(me, str(tmp_path / "tpl"))] * 2


# ---------------------------------------------------------------- a user, and sudo for one


@pytest.mark.users
def test_a_user_reads_and_writes_relative_paths_with_her_own_rights(open_dir: Path) -> None:
    home = open_dir / "alice"
    home.mkdir()
    shutil.copy(EXAMPLES / "train.sbatch", home / "train.sbatch")
    shutil.copy(EXAMPLES / "job-1234.out", home / "job-1234.out")
    _alices(home)
    for secret in ("secret.sbatch", "secret.out"):  # root's own, in her directory
        (home / secret).write_text((EXAMPLES / "job-1234.out").read_text())
        (home / secret).chmod(0o600)

    assert _as_alice(home, "template", "analyse", "train.sbatch").returncode == 0
    refused = _as_alice(home, "template", "analyse", "secret.sbatch")
    assert refused.returncode == 3, refused.stderr
    assert "denied" in refused.stderr
    log = _as_alice(home, "diagnose", "--log", "secret.out")
    assert log.returncode == 3, log.stderr
    imported = _as_alice(
        home, "template", "import", "train.sbatch", "--dialect", "hf", "--name", "clm"
    )
    assert imported.returncode == 0, imported.stderr
    assert (home / "templates" / "clm" / "job.sbatch").stat().st_uid == _alice().pw_uid
    shown = _as_alice(home, "template", "show", "templates/clm")
    assert shown.returncode == 0, shown.stderr
    assert "revisions: 1" in shown.stdout.splitlines()


def _as_sudo(*args: str, system_config: Path | None = None) -> Result:
    """`sudo slurm-medic ARGS` for alice: root with SUDO_UID, and `system_config` standing in
    for /etc/slurm-medic/config.toml."""
    env = {"SUDO_UID": str(_alice().pw_uid), "SLURM_MEDIC_CONFIG": None}
    with mock.patch("daemon.config.DEFAULT_CONFIG_PATH", system_config or Path("/nonexistent")):
        return CliRunner().invoke(main, list(args), env=env)


@pytest.mark.users
def test_under_sudo_submit_reads_relative_paths_as_the_person(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch, slurm: RecordingSlurm
) -> None:
    record, config = _record(open_dir)
    home = open_dir / "alice"
    home.mkdir()
    shutil.copytree(HF_TEMPLATE, home / "tpl")
    (home / "run").mkdir()
    _alices(home)
    monkeypatch.chdir(home)
    submitted = _as_sudo("submit", "tpl", "--work-dir", "run", "--json", system_config=config)
    assert submitted.exit_code == 0, submitted.output
    assert slurm.submitted == [("alice", str(home / "run"))]
    assert _lineages(record) == [("alice", str(home / "tpl"))]

    hidden = open_dir / "root-only"  # root's 0700: not hers to look into
    (hidden / "tpl").mkdir(parents=True)
    hidden.chmod(0o700)
    monkeypatch.chdir(hidden)
    answers = []
    for name in ("tpl", "nothing-here"):
        refused = _as_sudo("submit", name, system_config=config)
        assert refused.exit_code == 1, refused.output
        answers.append(refused.output.replace(name, "NAME"))
    assert answers[0] == answers[1]
    assert "denied" in answers[0]
    assert len(slurm.submitted) == 1


@pytest.mark.users
def test_under_sudo_the_commands_that_need_nothing_of_root_are_refused_before_looking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(HF_TEMPLATE, tmp_path / "tpl")
    shutil.copy(EXAMPLES / "train.sbatch", tmp_path / "train.sbatch")
    shutil.copy(EXAMPLES / "job-1234.out", tmp_path / "job-1234.out")
    monkeypatch.chdir(tmp_path)
    for there, missing in (
        (("template", "show", "tpl"), ("template", "show", "gone")),
        (("template", "analyse", "train.sbatch"), ("template", "analyse", "gone.sbatch")),
        (("diagnose", "--log", "job-1234.out"), ("diagnose", "--log", "gone.out")),
    ):
        answers = [_as_sudo(*args) for args in (there, missing)]
        assert [answer.exit_code for answer in answers] == [2, 2]
        assert answers[0].output == answers[1].output  # nothing of the path is told
        assert "under sudo for uid" in answers[0].output
        assert "run it without sudo" in answers[0].output
    into = _as_sudo("template", "import", "train.sbatch", "--dialect", "hf", "--name", "clm")
    assert into.exit_code == 2
    assert not (tmp_path / "templates").exists()  # nothing written for her as root
    assert invoke("template", "show", "tpl").exit_code == 0  # root itself: as before
    config = _as_sudo("db", "current", "--config", "config.toml")
    assert config.exit_code == 2
    assert "refused: --config" in config.output
