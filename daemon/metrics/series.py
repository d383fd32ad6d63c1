"""What only the running daemon knows, as Prometheus series in this process: probe durations
and failures, Slurm command errors, cycles and the steps that failed, and leadership.

Every label takes its values from a fixed set (anything else is `other`), so no node, job,
user or message ever becomes a series. The series live on their own registry, `IN_PROCESS`,
which the daemon's /metrics serves beside the record's (`daemon.metrics.serve`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from daemon import process
from daemon.process import CommandResult
from daemon.slurm.backend import CommandRunner

IN_PROCESS = CollectorRegistry(auto_describe=True)

OTHER = "other"
# The Slurm commands slurm-medic runs; a command outside this set is counted as `other`.
SLURM_COMMANDS = ("sacct", "squeue", "scontrol", "sbatch", "scancel", "sinfo")
# The daemon's cycle steps (`service.Daemon.cycle`); a step outside this set is `other`.
STEPS = ("reconcile", "poll", "wedged", "act", "sweep", "verify", "expire", "notify")


class ProbeFailure(StrEnum):
    """Why a node's probe document could not be fetched."""

    HOST_KEY = "host_key"  # unknown or changed host key: refused
    SSH = "ssh"  # no connection, authentication, timeout
    PROBE_EXIT = "probe_exit"  # the probe program ran and exited non-zero
    INTERNAL = "internal"  # a fault of slurm-medic's own fetch


# Seconds: an SSH round trip with the probe program's work is about one to a few seconds; the
# command timeout (45 s by default) is the top.
PROBE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 45.0, 90.0)
# Seconds: a quiet cycle is milliseconds; a poll of thousands of ended jobs a second or two.
CYCLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

PROBE_DURATION = Histogram(
    "slurm_medic_probe_duration_seconds",
    "Time to fetch one node's probe document over SSH, failed fetches included.",
    buckets=PROBE_BUCKETS,
    registry=IN_PROCESS,
)
PROBE_FAILURES = Counter(
    "slurm_medic_probe_failures",
    "Node probes that returned no document, by reason.",
    ["reason"],
    registry=IN_PROCESS,
)
SLURM_COMMAND_ERRORS = Counter(
    "slurm_medic_slurm_command_errors",
    "Slurm command runs that failed (non-zero exit, timeout, could not start), by command;"
    " each retry counts.",
    ["command"],
    registry=IN_PROCESS,
)
CYCLES = Counter("slurm_medic_cycles", "Cycles run (a standby's included).", registry=IN_PROCESS)
CYCLE_DURATION = Histogram(
    "slurm_medic_cycle_duration_seconds",
    "Time one cycle took, all its steps.",
    buckets=CYCLE_BUCKETS,
    registry=IN_PROCESS,
)
STEP_FAILURES = Counter(
    "slurm_medic_step_failures",
    "Cycle steps that failed (the step's transaction rolled back), by step.",
    ["step"],
    registry=IN_PROCESS,
)
LEADER = Gauge(
    "slurm_medic_leader",
    "1 while this daemon holds the leader lock, 0 otherwise.",
    registry=IN_PROCESS,
)

# Every label value present from the start: a counter that has not moved reads 0, not absent,
# so `increase()` and the alert rules see its first error.
for _reason in ProbeFailure:
    PROBE_FAILURES.labels(reason=_reason.value)
for _command in (*SLURM_COMMANDS, OTHER):
    SLURM_COMMAND_ERRORS.labels(command=_command)
for _step in (*STEPS, OTHER):
    STEP_FAILURES.labels(step=_step)


def probe_fetched(seconds: float, failure: ProbeFailure | None) -> None:
    PROBE_DURATION.observe(seconds)
    if failure is not None:
        PROBE_FAILURES.labels(reason=failure.value).inc()


def slurm_command_name(argv: Sequence[str]) -> str:
    """The label of a Slurm command: its program's base name if it is one of ours."""
    name = os.path.basename(argv[0]) if argv else ""
    return name if name in SLURM_COMMANDS else OTHER


def step_failed(step: str) -> None:
    STEP_FAILURES.labels(step=step if step in STEPS else OTHER).inc()


def cycle_ran(seconds: float, *, leader: bool) -> None:
    CYCLES.inc()
    CYCLE_DURATION.observe(seconds)
    LEADER.set(1 if leader else 0)


class SlurmErrorCounter:
    """The subprocess seam (`daemon.process.run`'s shape) counting each failed Slurm command
    by name, for the Slurm backend: whatever the backend then makes of the failure (a retry,
    an answer such as "no such job"), the command did fail."""

    def __init__(self, runner: CommandRunner = process.run) -> None:
        self._runner = runner

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = False,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        try:
            result = self._runner(
                argv, timeout=timeout, check=check, input_text=input_text, env=env, cwd=cwd
            )
        except process.CommandError:
            SLURM_COMMAND_ERRORS.labels(command=slurm_command_name(argv)).inc()
            raise
        if not result.ok:
            SLURM_COMMAND_ERRORS.labels(command=slurm_command_name(argv)).inc()
        return result
