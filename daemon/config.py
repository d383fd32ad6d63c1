"""The daemon's one settings object: TOML file, then `SLURM_MEDIC_...` environment, then flags.

Each option is declared once, here. The file is `/etc/slurm-medic/config.toml` unless
`--config` or `SLURM_MEDIC_CONFIG` names another; nested environment names use `__`
(`SLURM_MEDIC_POLICY__DRY_RUN=true`). Everything is validated at start-up, and a bad value is
refused with the option's dotted name, so a daemon never starts half-configured; so is a
`SLURM_MEDIC_` variable that names no option, which would otherwise be ignored in silence.

A process that runs as root for someone else (under sudo, or set-user/group-id) takes its
policy and its record from the system file alone: `load_settings` refuses `--config`,
`--database`, setting flags and every `SLURM_MEDIC_` variable there, since whoever ran sudo
chose them (deploy/README.md, "Privilege model").
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from daemon.evidence.joblog import DEFAULT_BYTE_BUDGET
from daemon.evidence.prober import ProbeSettings
from daemon.evidence.records import FindingKind
from daemon.metrics.settings import MetricsSettings
from daemon.notify.settings import NotifySettings
from daemon.owner_serve import MAX_SCAN_BYTES
from daemon.privilege import confinement
from daemon.slurm.records import JobState
from daemon.store.settings import StoreSettings
from daemon.web.settings import WebSettings

DEFAULT_CONFIG_PATH = Path("/etc/slurm-medic/config.toml")
CONFIG_ENV = "SLURM_MEDIC_CONFIG"
ENV_PREFIX = "SLURM_MEDIC_"
MAX_STEP_PATTERN_CHARS = 1024  # one format's pattern; the owner's child runs it under its CPU limit

# Checked with Python's engine (see `_Section`): `\Z` is the very end, so a trailing newline
# is refused whatever the engine's idea of `$`.
Name = Annotated[str, StringConstraints(pattern=r"\A[A-Za-z0-9_.@-]{1,64}\Z")]

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


class PrivilegeError(ConfigError):
    """A setting chosen by someone who is not really root, in a process that runs as root."""


class DatabaseUrlError(ConfigError):
    """The `--database` URL is not one the record supports."""


class _Section(BaseModel):
    # pydantic's default engine (Rust) has no `\Z`; Python's is the one the project writes for.
    model_config = ConfigDict(frozen=True, extra="forbid", regex_engine="python-re")


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
    # A lineage job that has left slurmctld's queue is looked up by its id until accounting
    # has its final record, for at most this long (slurmdbd outages last minutes to days);
    # then that it never came is put on the record.
    ended_record_wait_s: float = Field(default=7 * 86400.0, ge=60, le=90 * 86400)
    # A submission's intent (a first submission or a relaunch) is declared never submitted only
    # once it is this old: accounting shows a new job a few seconds late, and a job missed would
    # be submitted twice.
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
    after `grace_s` (long enough for a framework's own abort to win if it is coming). Its log is
    scanned back at most `log_tail_bytes` from the end at each look: a hanging job's log ends
    with the failure, before any timeout cascade."""

    enabled: bool = True
    grace_s: float = Field(default=120.0, ge=0, le=86400)
    log_tail_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=MAX_SCAN_BYTES)


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
    # Levers whose tries per lineage differ from max_attempts_per_rule, by name.
    max_attempts_by_lever: dict[Name, Annotated[int, Field(ge=1, le=100)]] = {}
    max_no_progress: int = Field(default=2, ge=1, le=100)

    @field_validator("max_attempts_by_lever")
    @classmethod
    def _levers_exist(cls, value: dict[str, int]) -> dict[str, int]:
        """A misspelt lever would leave its budget at the default in silence."""
        from remediators.registry import BY_NAME  # noqa: PLC0415  (only when one is set)

        unknown = sorted(set(value) - set(BY_NAME))
        if unknown:
            raise ValueError(
                f"no lever named {', '.join(unknown)}; levers: {', '.join(sorted(BY_NAME))}"
            )
        return value


class VerifySettings(_Section):
    """A relaunch is verified once it logs `margin_steps` past the step that failed and a
    checkpoint newer than the one it resumed from exists; a relaunch still pending after
    `pending_timeout_s`, or running `max_duration_s` without showing that, counts as no
    progress."""

    margin_steps: int = Field(default=2, ge=0, le=1_000_000)
    pending_timeout_s: float = Field(default=24 * 3600, gt=0)
    max_duration_s: float = Field(default=7 * 24 * 3600, gt=0)
    interval_s: float = Field(default=15.0, gt=0, le=3600)


class SweepSettings(_Section):
    """The fleet sweep: off until `enabled`. Every node (or those of `nodes`, a hostlist) is
    probed once per `interval_s`, each at its own moment of the interval, and each node right
    after a job on it ends (`after_job`). A finding in `drain_now` drains the node at once, one
    in `drain_after_job` lets the running job finish (Slurm's DRAINING), anything else is
    recorded only; the drains count against `policy.max_drains_per_hour` with the incidents'.
    A node drained for a pending remap returns to service by itself only with `auto_resume`,
    once the remap is applied and `resume_after_healthy` sweeps in a row found it healthy."""

    enabled: bool = False
    interval_s: float = Field(default=3600.0, ge=5, le=7 * 86400)
    after_job: bool = True
    nodes: str | None = Field(default=None, min_length=1, max_length=4096)
    drain_now: tuple[FindingKind, ...] = (
        FindingKind.REMAP_FAILURE,
        FindingKind.ECC_UNCORRECTABLE_VOLATILE,
        FindingKind.FALLEN_OFF_BUS,
        FindingKind.GPU_MISSING,
        FindingKind.XID_HARDWARE,
    )
    drain_after_job: tuple[FindingKind, ...] = (FindingKind.REMAP_PENDING,)
    auto_resume: bool = False
    resume_after_healthy: int = Field(default=3, ge=1, le=100)

    @field_validator("drain_after_job")
    @classmethod
    def _one_rule_per_finding(
        cls, value: tuple[FindingKind, ...], info: ValidationInfo
    ) -> tuple[FindingKind, ...]:
        both = sorted(set(value) & set(info.data.get("drain_now", ())))
        if both:
            raise ValueError(f"{', '.join(both)} cannot be in both drain_now and drain_after_job")
        if FindingKind.UNREACHABLE in value:
            raise ValueError("an unreachable node is never drained on that alone")
        return value

    @field_validator("drain_now")
    @classmethod
    def _never_on_silence(cls, value: tuple[FindingKind, ...]) -> tuple[FindingKind, ...]:
        if FindingKind.UNREACHABLE in value:
            raise ValueError("an unreachable node is never drained on that alone")
        return value

    @field_validator("nodes")
    @classmethod
    def _hostlist(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from daemon.slurm.errors import SlurmParseError  # noqa: PLC0415
        from daemon.slurm.hostlist import expand_hostlist  # noqa: PLC0415

        try:
            if not expand_hostlist(value):
                raise ValueError("names no node")
        except SlurmParseError as error:
            raise ValueError(str(error)) from error
        return value


class Settings(BaseSettings):
    """Everything the daemon is told, validated as one object."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    hook_socket: Path = Path("/run/slurm-medic/hook.sock")
    store: StoreSettings = StoreSettings()
    probe: ProbeSettings | None = None
    watcher: WatcherSettings = WatcherSettings()
    managed: ManagedSettings = ManagedSettings()
    wedge: WedgeSettings = WedgeSettings()
    policy: PolicySettings = PolicySettings()
    verify: VerifySettings = VerifySettings()
    sweep: SweepSettings = SweepSettings()
    metrics: MetricsSettings = MetricsSettings()
    web: WebSettings = WebSettings()
    notify: NotifySettings | None = None
    slurm_timeout_s: float = Field(default=30.0, gt=0, le=600)
    # How far back from a log's end its scan may look: the owner's reader opens the log and
    # scans it as `slurm-medic diagnose --log` does, only as far back as the root failure needs,
    # within the scanner's time limit; nothing but the findings is handed over.
    log_max_bytes: int = Field(default=DEFAULT_BYTE_BUDGET, ge=64 * 1024, le=MAX_SCAN_BYTES)
    # The training step, for a site whose programs print it in a format the scanner does not
    # know (HF/Lightning bars, Megatron `iteration`, DeepSpeed `step=`, Composer `[batch=`,
    # `global_step`): a Python regex whose first group is the step. It replaces the built-in
    # formats, as `diagnose --step-pattern` does, in every log scan the daemon makes.
    step_pattern: str | None = Field(default=None, min_length=1, max_length=MAX_STEP_PATTERN_CHARS)

    @field_validator("step_pattern")
    @classmethod
    def _step_pattern_captures_a_step(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            groups = re.compile(value).groups
        except re.error as error:
            raise ValueError(f"not a regular expression: {error}") from error
        if groups < 1:
            raise ValueError("needs a group that captures the step number")
        return value

    @model_validator(mode="after")
    def _sweep_needs_the_probe(self) -> Settings:
        """A sweep enabled with no way to reach the nodes would sweep nothing, in silence."""
        if self.sweep.enabled and self.probe is None:
            raise ValueError("sweep.enabled needs the [probe] section: nodes are swept over SSH")
        return self

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


def medic_variables(environ: Mapping[str, str]) -> list[str]:
    """The environment's SLURM_MEDIC_ names, in any case (pydantic-settings ignores case)."""
    return sorted(name for name in environ if name.upper().startswith(ENV_PREFIX))


def is_known_variable(name: str) -> bool:
    """SLURM_MEDIC_CONFIG, or a name pydantic-settings maps onto an option of `Settings`."""
    if name == CONFIG_ENV:  # read by its exact name, unlike the options
        return True
    parts = name[len(ENV_PREFIX) :].lower().split("__")
    model: type[BaseModel] | None = Settings
    for part in parts:
        if model is None or part not in model.model_fields:
            return False
        model = _model_of(model.model_fields[part].annotation)
    return True


def _model_of(annotation: object) -> type[BaseModel] | None:
    """The section model an option holds (`ProbeSettings | None` holds ProbeSettings)."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def load_settings(
    config: str | os.PathLike[str] | None = None,
    *,
    database: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read and validate the config; `database` (a URL) and `overrides` are the command
    line's flags (highest).

    A file named by flag or environment must exist; the default file may be absent (every
    option then has its default). Raises `PrivilegeError` when a process running as root
    for someone else is given any setting but the system file's, and `ConfigError` naming
    each bad option or unknown SLURM_MEDIC_ variable.
    """
    _check_privilege(config, database, overrides or {}, os.environ)
    unknown = [name for name in medic_variables(os.environ) if not is_known_variable(name)]
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}: SLURM_MEDIC_ names"
            f" {CONFIG_ENV} or an option, as SLURM_MEDIC_<SECTION>__<OPTION>"
        )
    flags = dict(overrides or {})
    if database is not None:
        flags["store"] = {**flags.get("store", {}), "url": _checked_database_url(database)}
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
        return FileSettings(**flags)
    except ValidationError as error:
        raise ConfigError(_describe(in_use, error)) from error
    except SettingsError as error:
        # A SLURM_MEDIC_ value that is not the JSON a section needs.
        cause = f": {error.__cause__}" if error.__cause__ else ""
        raise ConfigError(f"environment: {error}{cause}") from error


def _check_privilege(
    config: str | os.PathLike[str] | None,
    database: str | None,
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
) -> None:
    """Refuse what the caller chose when root runs for someone else; ignoring it in silence
    would leave them thinking it took effect."""
    reason = confinement(environ)
    if reason is None:
        return
    given = [
        *(["--config"] if config is not None else []),
        *(["--database"] if database is not None else []),
        *(f"the setting {name}" for name in _dotted(overrides)),
        *medic_variables(environ),
    ]
    if given:
        raise PrivilegeError(
            f"{reason}: only the system config {DEFAULT_CONFIG_PATH} decides policy and the"
            f" record there; refused: {', '.join(given)}"
        )


def _dotted(overrides: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _checked_database_url(url: str) -> str:
    try:
        return StoreSettings(url=url).url
    except ValidationError as error:
        problems = "; ".join(str(item["msg"]) for item in error.errors())
        raise DatabaseUrlError(f"{url!r}: {problems}") from error


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
