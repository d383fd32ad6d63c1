"""The settings object: file, then environment, then flags; bad values refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from daemon import installable
from daemon.cli import main
from daemon.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    ManagedSettings,
    Settings,
    config_path,
    is_known_variable,
    load_settings,
)
from daemon.diagnosis import FailureKind, MidRunCause, Onset
from daemon.pipeline import planner_policy
from daemon.planner import LineageHistory, Outcome, Proposal, plan
from daemon.slurm.records import JobState
from tests.test_planner import _attempt, diagnosis, example


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


@pytest.mark.parametrize(
    ("pattern", "why"),
    [("step (", "not a regular expression"), (r"step \d+", "captures the step number")],
)
def test_a_step_pattern_must_compile_and_capture_the_step(
    tmp_path: Path, pattern: str, why: str
) -> None:
    path = write(tmp_path, f"step_pattern = {json.dumps(pattern)}\n")
    with pytest.raises(ConfigError, match=why):
        load_settings(path)


def test_a_step_pattern_that_captures_is_kept(tmp_path: Path) -> None:
    path = write(tmp_path, "step_pattern = 'train\\| it (\\d+)/'\n")
    assert load_settings(path).step_pattern == r"train\| it (\d+)/"


def test_watch_states_parse_as_job_states(tmp_path: Path) -> None:
    path = write(tmp_path, '[watcher]\nstates = ["FAILED", "OUT_OF_MEMORY"]\n')
    assert load_settings(path).watcher.states == (JobState.FAILED, JobState.OUT_OF_MEMORY)


def test_the_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(installable.__file__).with_name("config.example.toml")
    settings = load_settings(example)
    assert settings.policy.max_drains_per_hour == 2


def test_managed_matches_any_of_account_partition_user() -> None:
    managed = ManagedSettings(accounts=("ml",), partitions=("gpu",), users=("carol",))
    assert managed.matches(account="ml", partition=None, user="dave")
    assert managed.matches(account=None, partition="gpu", user="dave")
    assert managed.matches(account=None, partition=None, user="carol")
    assert not managed.matches(account="physics", partition="cpu", user="dave")


def test_an_unknown_medic_variable_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt option would otherwise be ignored, and the daemon run on the default."""
    path = write(tmp_path, "[policy]\ndry_run = true\n")
    monkeypatch.setenv("SLURM_MEDIC_POLICY__DRY_RUNN", "false")
    monkeypatch.setenv("slurm_medic_bogus", "1")  # pydantic-settings reads names in any case
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert "SLURM_MEDIC_POLICY__DRY_RUNN" in str(caught.value)
    assert "slurm_medic_bogus" in str(caught.value)


def test_the_known_medic_variables_are_the_options_and_the_config_file() -> None:
    for name in (
        "SLURM_MEDIC_CONFIG",
        "SLURM_MEDIC_HOOK_SOCKET",  # the epilog hook's, and the daemon's hook_socket
        "SLURM_MEDIC_STORE__URL",
        "SLURM_MEDIC_STORE",  # a whole section, as JSON
        "SLURM_MEDIC_PROBE__KEY_PATH",  # inside an optional section
        "slurm_medic_policy__dry_run",
    ):
        assert is_known_variable(name), name
    for name in (
        "SLURM_MEDIC_UPDATE_GOLDEN",  # the golden tests' switch: no daemon process sees it
        "SLURM_MEDIC_STORE__URL__HOST",
        "SLURM_MEDIC_POLICY__",
        "slurm_medic_config",  # read by its exact name only
    ):
        assert not is_known_variable(name), name


def test_a_section_that_is_not_json_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_MEDIC_POLICY", "{dry_run: true}")
    with pytest.raises(ConfigError, match='environment: error parsing value for field "policy"'):
        load_settings()


def test_the_run_command_refuses_an_unknown_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_MEDIC_POLL_INTERVAL", "1")
    result = CliRunner().invoke(main, ["run", "--once", "--config", str(write(tmp_path, ""))])
    assert result.exit_code == 2
    assert "unknown environment variable(s) SLURM_MEDIC_POLL_INTERVAL" in result.output


@pytest.mark.parametrize("name", ["clm\n", "clm\nrm", "", "a b", "x" * 65])
def test_a_name_is_one_short_line_of_safe_characters(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, f"[managed]\nusers = [{json.dumps(name)}]\n")
    with pytest.raises(ConfigError, match=r"managed\.users\.0"):
        load_settings(path)
    assert load_settings(write(tmp_path, '[managed]\nusers = ["clm.x@y-z_1"]\n')).managed.users


def test_a_levers_own_budget_reaches_the_planner(tmp_path: Path) -> None:
    """`policy.max_attempts_by_lever` lets one lever be tried again where the per-rule
    budget (1) would skip it: the micro-batch is cut a second time."""
    megatron = example("megatron")
    mid_run = diagnosis(
        FailureKind.TRUE_OOM, onset=Onset.MID_RUN, step=100, mid_run_cause=MidRunCause.GROWTH
    )
    # The first cut got past the failing step (100 -> 140), then the run failed again.
    history = LineageHistory(
        (_attempt("micro_batch_down", 0, Outcome.SAME_FAILURE, 140, megatron),)
    )
    smaller = dataclasses.replace(megatron, knobs={**megatron.knobs, "micro_batch_size": 2})

    def first_choice(settings: Settings) -> str:
        planned = plan(mid_run, smaller, history, planner_policy(settings))
        assert isinstance(planned, Proposal)
        return planned.remediation.remediator

    assert first_choice(load_settings(write(tmp_path, ""))) == "recompute_selective"
    budgets = write(tmp_path, "[policy.max_attempts_by_lever]\nmicro_batch_down = 2\n")
    assert first_choice(load_settings(budgets)) == "micro_batch_down"


def test_a_budget_for_a_lever_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "[policy.max_attempts_by_lever]\nmicro_batch_dwon = 2\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert "policy.max_attempts_by_lever: Value error, no lever named micro_batch_dwon" in str(
        caught.value
    )
    with pytest.raises(ConfigError, match=r"policy\.max_attempts_by_lever\.micro_batch_down"):
        load_settings(write(tmp_path, "[policy.max_attempts_by_lever]\nmicro_batch_down = 0\n"))
