"""What a framework dialect is: its knobs, what role each plays, how they render, how it resumes.

A dialect is data plus a few pure functions. The remediators speak in roles (micro-batch,
recompute, sharding...), never in one framework's flag names, so one lever serves every dialect.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

# A knob's value: int, bool, str (enum choice or path), a tuple of names (node list, module
# list), or an env map as sorted (name, value) pairs. Tuples keep revisions immutable.
KnobValue = int | bool | str | tuple[str, ...] | tuple[tuple[str, str], ...]
Knobs = Mapping[str, KnobValue]

RECOMPUTE_NONE = "none"
RECOMPUTE_SELECTIVE = "selective"
RECOMPUTE_FULL = "full"

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
_MAX_TEXT = 4096


class KnobError(ValueError):
    """A knob value of the wrong type, outside its range, or breaking the dialect's invariant."""


class KnobKind(StrEnum):
    INT = "int"
    BOOL = "bool"
    ENUM = "enum"
    TEXT = "text"  # a path or free string; always shell-quoted where it lands
    NAMES = "names"  # a list of identifiers drawn from `choices` (e.g. recompute modules)
    NODES = "nodes"  # a list of Slurm node names
    ENV = "env"  # environment variables exported before the launch


class Role(StrEnum):
    """What a knob means to the remediators, whatever the framework calls it."""

    NODES = "nodes"
    GPUS_PER_NODE = "gpus_per_node"
    EXCLUDE = "exclude"
    ENV = "env"
    MICRO_BATCH = "micro_batch"
    GRAD_ACCUM = "grad_accum"
    GLOBAL_BATCH = "global_batch"
    TENSOR_PARALLEL = "tensor_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    RECOMPUTE = "recompute"
    SHARDING = "sharding"
    EVAL_BATCH = "eval_batch"
    EVAL_ACCUM = "eval_accum"
    GENERATION_LENGTH = "generation_length"
    WORKERS = "workers"
    SEQ_LENGTH = "seq_length"
    OPTIMIZER = "optimizer"
    RESUME = "resume"
    RESUME_TAG = "resume_tag"


@dataclass(frozen=True)
class KnobSpec:
    """One knob: its type, its range or choices, and a line on what it does."""

    name: str
    kind: KnobKind
    description: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    unset: int | str | None = None  # the value meaning "not set in the script": not rendered

    def is_set(self, value: KnobValue) -> bool:
        return self.unset is None or value != self.unset or isinstance(value, bool)

    def validate(self, value: object) -> KnobValue:
        """Check and normalise one value (lists become tuples, env maps sorted pairs)."""
        if self.unset is not None and value == self.unset and not isinstance(value, bool):
            return self.unset
        if self.kind is KnobKind.INT:
            if isinstance(value, bool) or not isinstance(value, int):
                raise KnobError(f"{self.name}: expected an integer, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                raise KnobError(f"{self.name}: {value} is below the minimum {self.minimum}")
            if self.maximum is not None and value > self.maximum:
                raise KnobError(f"{self.name}: {value} is above the maximum {self.maximum}")
            return value
        if self.kind is KnobKind.BOOL:
            if not isinstance(value, bool):
                raise KnobError(f"{self.name}: expected true or false, got {value!r}")
            return value
        if self.kind is KnobKind.ENUM:
            if not isinstance(value, str) or value not in self.choices:
                raise KnobError(f"{self.name}: {value!r} is not one of {', '.join(self.choices)}")
            return value
        if self.kind is KnobKind.TEXT:
            return _text(self.name, value)
        if self.kind is KnobKind.NAMES:
            names = _names(self.name, value)
            unknown = [name for name in names if name not in self.choices]
            if unknown:
                raise KnobError(f"{self.name}: unknown {unknown}; choose from {self.choices}")
            return names
        if self.kind is KnobKind.NODES:
            nodes = _names(self.name, value)
            bad = [node for node in nodes if not _NODE_NAME.match(node)]
            if bad:
                raise KnobError(f"{self.name}: not a node name: {bad!r}")
            return tuple(dict.fromkeys(nodes))
        return _env(self.name, value)


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise KnobError(f"{name}: expected a string, got {value!r}")
    if len(value) > _MAX_TEXT:
        raise KnobError(f"{name}: longer than {_MAX_TEXT} characters")
    if any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise KnobError(f"{name}: control characters (newline, NUL...) are not allowed")
    return value


def _names(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        raise KnobError(f"{name}: expected a list of strings, got {value!r}")
    return tuple(_text(name, item) for item in value)


def _env(name: str, value: object) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, tuple | list) and all(
        isinstance(pair, tuple | list) and len(pair) == 2 for pair in value
    ):
        pairs = [(pair[0], pair[1]) for pair in value]
    else:
        raise KnobError(f"{name}: expected a table of environment variables, got {value!r}")
    result: dict[str, str] = {}
    for key, item in pairs:
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise KnobError(f"{name}: not an environment variable name: {key!r}")
        result[key] = _text(f"{name}.{key}", item)
    return tuple(sorted(result.items()))


@dataclass(frozen=True)
class BatchGeometry:
    """The invariant's terms: global = micro x accum x data-parallel world."""

    micro: int
    accum: int
    data_parallel: int
    global_batch: int


@dataclass(frozen=True)
class Dialect:
    """A framework's knob map: which knobs exist, what they mean, how they render and resume.

    `render_args` gives the launch command's flags, `render_env` the exported variables that
    carry knobs, `render_config` a config file's text (DeepSpeed's JSON) or None.
    `recognise` maps the flags and variables an imported script may carry to knob names.
    """

    name: str
    title: str
    knobs: tuple[KnobSpec, ...]
    roles: Mapping[Role, str]
    render_args: Callable[[Knobs], tuple[str, ...]]
    render_env: Callable[[Knobs], tuple[tuple[str, str], ...]]
    render_config: Callable[[Knobs, Mapping[str, object]], str | None]
    global_batch_fixed: bool
    invariant: str
    resume_note: str
    recognise_flags: Mapping[str, str] = field(default_factory=dict)
    recognise_env: Mapping[str, str] = field(default_factory=dict)
    full_recompute_extras: Mapping[str, KnobValue] = field(default_factory=dict)
    defaults: Mapping[str, KnobValue] = field(default_factory=dict)

    def spec(self, knob: str) -> KnobSpec:
        for spec in self.knobs:
            if spec.name == knob:
                return spec
        raise KnobError(f"dialect {self.name} has no knob {knob!r}")

    def knob_for(self, role: Role) -> str | None:
        return self.roles.get(role)

    def geometry(self, knobs: Knobs) -> BatchGeometry:
        """The batch terms of these knobs; raises when they cannot satisfy the invariant."""
        nodes = _int(knobs, self.roles[Role.NODES])
        gpus = _int(knobs, self.roles[Role.GPUS_PER_NODE])
        tensor = _role_int(self, knobs, Role.TENSOR_PARALLEL)
        pipeline = _role_int(self, knobs, Role.PIPELINE_PARALLEL)
        micro = _int(knobs, self.roles[Role.MICRO_BATCH])
        world = nodes * gpus
        if world % (tensor * pipeline):
            raise KnobError(
                f"{world} GPUs ({nodes} nodes x {gpus}) do not divide into "
                f"tensor {tensor} x pipeline {pipeline} model-parallel groups"
            )
        data_parallel = world // (tensor * pipeline)
        if self.global_batch_fixed:
            global_batch = _int(knobs, self.roles[Role.GLOBAL_BATCH])
            if global_batch % (micro * data_parallel):
                raise KnobError(
                    f"global batch {global_batch} is not a multiple of micro-batch {micro} x "
                    f"data-parallel {data_parallel}"
                )
            accum = global_batch // (micro * data_parallel)
        else:
            accum = _int(knobs, self.roles[Role.GRAD_ACCUM])
            global_batch = micro * accum * data_parallel
        return BatchGeometry(micro, accum, data_parallel, global_batch)


def _int(knobs: Knobs, name: str) -> int:
    value = knobs[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise KnobError(f"{name}: expected an integer, got {value!r}")
    return value


def _role_int(dialect: Dialect, knobs: Knobs, role: Role) -> int:
    name = dialect.roles.get(role)
    return 1 if name is None else _int(knobs, name)


COMMON_KNOBS: tuple[KnobSpec, ...] = (
    KnobSpec("nodes", KnobKind.INT, "nodes to allocate (#SBATCH --nodes)", 1, 4096),
    KnobSpec("gpus_per_node", KnobKind.INT, "GPUs and tasks per node", 1, 64),
    KnobSpec("exclude", KnobKind.NODES, "nodes this run must not use (#SBATCH --exclude)"),
    KnobSpec("env", KnobKind.ENV, "environment exported before the launch"),
)
COMMON_DEFAULTS: Mapping[str, KnobValue] = {
    "nodes": 1,
    "gpus_per_node": 8,
    "exclude": (),
    "env": (),
}
COMMON_ROLES: Mapping[Role, str] = {
    Role.NODES: "nodes",
    Role.GPUS_PER_NODE: "gpus_per_node",
    Role.EXCLUDE: "exclude",
    Role.ENV: "env",
}


def no_config(_knobs: Knobs, _base: Mapping[str, object]) -> str | None:
    """`render_config` of a dialect whose knobs all live on the command line or environment."""
    return None


def flag_if(condition: bool, *args: str) -> tuple[str, ...]:
    """The args when the condition holds, else nothing: how boolean flags render."""
    return args if condition else ()


def text(knobs: Knobs, name: str) -> str:
    value = knobs[name]
    if not isinstance(value, str):
        raise KnobError(f"{name}: expected a string, got {value!r}")
    return value


def integer(knobs: Knobs, name: str) -> int:
    return _int(knobs, name)
