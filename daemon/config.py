"""The daemon's one settings object: TOML file, then `SLURM_MEDIC_...` environment, then flags.

Each option is declared once, here. The file is `/etc/slurm-medic/config.toml` unless
`--config` or `SLURM_MEDIC_CONFIG` names another; nested environment names use `__`
(`SLURM_MEDIC_POLICY__DRY_RUN=true`). Everything is validated at start-up, and a bad value is
refused with the option's dotted name, so a daemon never starts half-configured.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from daemon.evidence.prober import ProbeSettings
from daemon.owner_files import MAX_TAIL_BYTES
from daemon.slurm.records import JobState
from daemon.store.settings import DEFAULT_STATE_DIR, StoreSettings

DEFAULT_CONFIG_PATH = Path("/etc/slurm-medic/config.toml")
CONFIG_ENV = "SLURM_MEDIC_CONFIG"
ENV_PREFIX = "SLURM_MEDIC_"

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")]

# States a finished-job poll asks accounting for: what a training job dies of, and COMPLETED,
# which is how a relaunch being verified usually ends.
DEFAULT_WATCH_STATES = (
    JobState.FAILED,
    JobState.OUT_OF_MEMORY,
    JobState.NODE_FAIL,
    JobState.CANCELLED,
    JobState.TIMEOUT,
    JobState.COMPLETED,
)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and every bad option."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WatcherSettings(_Section):
    """How the finished-job poll walks accounting: each window starts `overlap_s` before the
    stored cursor so a record slurmdbd wrote late is still seen (the store dedupes)."""

    poll_interval_s: float = Field(default=15.0, gt=0, le=3600)
    overlap_s: float = Field(default=120.0, ge=0, le=86400)
    # On a first start with no cursor: how far back to look.
    initial_lookback_s: float = Field(default=600.0, ge=0, le=30 * 86400)
    states: tuple[JobState, ...] = DEFAULT_WATCH_STATES
    running_interval_s: float = Field(default=15.0, gt=0, le=3600)
    # An incomplete accounting record (22.05's placeholder) is read again for this long.
    incomplete_record_wait_s: float = Field(default=60.0, ge=0, le=3600)
    # A relaunch's intent is declared never submitted only once it is this old: accounting
    # shows a new job a few seconds late, and a job missed would be submitted twice.
    reconcile_settle_s: float = Field(default=60.0, ge=5, le=3600)


class ManagedSettings(_Section):
    """Jobs diagnosed though no lineage owns them; they are recorded, never relaunched."""

    accounts: tuple[Name, ...] = ()
    partitions: tuple[Name, ...] = ()
    users: tuple[Name, ...] = ()

    def matches(self, *, account: str | None, partition: str | None, user: str) -> bool:
        return (
            (account is not None and account in self.accounts)
            or (partition is not None and partition in self.partitions)
            or user in self.users
        )


class WedgeSettings(_Section):
    """A running job whose log shows a rank's root failure while the others hang is cancelled
    after `grace_s` (long enough for a framework's own abort to win if it is coming)."""

    enabled: bool = True
    grace_s: float = Field(default=120.0, ge=0, le=86400)
    log_tail_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=MAX_TAIL_BYTES)


class PolicySettings(_Section):
    """Who may act without a person. Anything that changes the science always waits."""

    auto_approve: tuple[Name, ...] = (
        "allocator_expandable_segments",
        "allocator_max_split_size",
        "allocator_gc_threshold",
        "exclude_node",
        "drain_and_exclude",
        "dataloader_workers_down",
    )
    dry_run: bool = False
    paused: bool = False
    # Members of these groups (and root) may approve or reject any proposal, pause, resume a
    # node; a job's owner may decide on proposals for that job only.
    admin_groups: tuple[Name, ...] = ()
    max_relaunches_per_user_per_hour: int = Field(default=10, ge=0, le=10_000)
    max_relaunches_per_hour: int = Field(default=50, ge=0, le=100_000)
    max_drains_per_hour: int = Field(default=2, ge=0, le=1000)
    proposal_ttl_s: float = Field(default=7 * 86400, gt=0, le=365 * 86400)
    max_attempts_per_lineage: int = Field(default=6, ge=1, le=100)
    max_attempts_per_rule: int = Field(default=1, ge=1, le=100)
    max_no_progress: int = Field(default=2, ge=1, le=100)


class VerifySettings(_Section):
    """A relaunch is verified once it logs `margin_steps` past the step that failed and a
    checkpoint newer than the one it resumed from exists; a relaunch that never starts or
    never reaches its first step within the timeouts counts as no progress."""

    margin_steps: int = Field(default=2, ge=0, le=1_000_000)
    pending_timeout_s: float = Field(default=24 * 3600, gt=0)
    max_duration_s: float = Field(default=7 * 24 * 3600, gt=0)
    interval_s: float = Field(default=15.0, gt=0, le=3600)


class Settings(BaseSettings):
    """Everything the daemon is told, validated as one object."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    state_dir: Path = DEFAULT_STATE_DIR
    hook_socket: Path = Path("/run/slurm-medic/hook.sock")
    store: StoreSettings = StoreSettings()
    probe: ProbeSettings | None = None
    watcher: WatcherSettings = WatcherSettings()
    managed: ManagedSettings = ManagedSettings()
    wedge: WedgeSettings = WedgeSettings()
    policy: PolicySettings = PolicySettings()
    verify: VerifySettings = VerifySettings()
    slurm_timeout_s: float = Field(default=30.0, gt=0, le=600)
    # The owner's reader hands over at most MAX_TAIL_BYTES of a log's end.
    log_max_bytes: int = Field(default=MAX_TAIL_BYTES, ge=64 * 1024, le=MAX_TAIL_BYTES)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def config_path(flag: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    """Which file to read: the flag, else SLURM_MEDIC_CONFIG, else the system default."""
    if flag is not None:
        return Path(flag)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    return DEFAULT_CONFIG_PATH


def load_settings(
    config: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read and validate the config; `overrides` are the command line's flags (highest).

    A file named by flag or environment must exist; the default file may be absent (every
    option then has its default). Raises `ConfigError` naming each bad option.
    """
    path = config_path(config, os.environ)
    named = config is not None or bool(os.environ.get(CONFIG_ENV))
    in_use: Path | None = None
    if path.exists():
        _check_toml(path)
        in_use = path
    elif named:
        raise ConfigError(f"config file {path} does not exist")

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=in_use)

    try:
        return FileSettings(**dict(overrides or {}))
    except ValidationError as error:
        raise ConfigError(_describe(in_use, error)) from error


def _check_toml(path: Path) -> None:
    """A syntax error is reported with its line, before pydantic sees anything."""
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path} is not UTF-8: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from error


def _describe(path: Path | None, error: ValidationError) -> str:
    where = f"config {path}" if path else "config (no file)"
    problems = []
    for item in error.errors():
        name = ".".join(str(part) for part in item["loc"]) or "(top level)"
        problems.append(f"  {name}: {item['msg']}")
    return f"{where}: {error.error_count()} bad option(s)\n" + "\n".join(problems)
