"""The settings object: file, then environment, then flags; bad values refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    ManagedSettings,
    config_path,
    load_settings,
)
from daemon.slurm.records import JobState


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SLURM_MEDIC_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path,
        "[policy]\ndry_run = true\nmax_drains_per_hour = 5\n[watcher]\npoll_interval_s = 30\n",
    )
    monkeypatch.setenv("SLURM_MEDIC_POLICY__MAX_DRAINS_PER_HOUR", "7")
    monkeypatch.setenv("SLURM_MEDIC_WATCHER__POLL_INTERVAL_S", "20")
    settings = load_settings(path, overrides={"watcher": {"poll_interval_s": 3}})
    assert settings.policy.dry_run is True  # the file, untouched by the others
    assert settings.policy.max_drains_per_hour == 7  # the environment beats the file
    assert settings.watcher.poll_interval_s == 3  # a flag beats both


def test_the_environment_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[policy]\nmax_relaunches_per_hour = 3\n")
    monkeypatch.setenv("SLURM_MEDIC_CONFIG", str(path))
    assert config_path(None, {"SLURM_MEDIC_CONFIG": str(path)}) == path
    assert config_path(None, {}) == DEFAULT_CONFIG_PATH
    assert load_settings().policy.max_relaunches_per_hour == 3


def test_a_named_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_every_bad_option_is_named(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[watcher]\npoll_interval_s = -1\n[policy]\nmax_drains_per_hour = 'many'\nbogus = 1\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    message = str(caught.value)
    assert str(path) in message
    assert "watcher.poll_interval_s" in message
    assert "policy.max_drains_per_hour" in message
    assert "policy.bogus" in message


def test_toml_syntax_error_has_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[policy\ndry_run = true\n")
    with pytest.raises(ConfigError, match=r"not valid TOML.*line 1"):
        load_settings(path)


def test_a_store_url_of_another_database_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, '[store]\nurl = "mysql://x/y"\n')
    with pytest.raises(ConfigError, match=r"store\.url"):
        load_settings(path)


def test_watch_states_parse_as_job_states(tmp_path: Path) -> None:
    path = write(tmp_path, '[watcher]\nstates = ["FAILED", "OUT_OF_MEMORY"]\n')
    assert load_settings(path).watcher.states == (JobState.FAILED, JobState.OUT_OF_MEMORY)


def test_the_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parent.parent / "deploy" / "config.example.toml"
    settings = load_settings(example)
    assert settings.policy.max_drains_per_hour == 2


def test_managed_matches_any_of_account_partition_user() -> None:
    managed = ManagedSettings(accounts=("ml",), partitions=("gpu",), users=("carol",))
    assert managed.matches(account="ml", partition=None, user="dave")
    assert managed.matches(account=None, partition="gpu", user="dave")
    assert managed.matches(account=None, partition=None, user="carol")
    assert not managed.matches(account="physics", partition="cpu", user="dave")
