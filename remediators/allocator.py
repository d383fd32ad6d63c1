"""The caching allocator's options: the first moves against fragmentation.

They change nothing about the model or the batch, so they never change the science. They
merge into whichever of PYTORCH_ALLOC_CONF (torch >= 2.9) and PYTORCH_CUDA_ALLOC_CONF the
template already sets, keeping every other option; with neither set they write
PYTORCH_CUDA_ALLOC_CONF, which every torch release reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.diagnosis import Diagnosis
from daemon.dialects.base import Knobs, Role
from daemon.templates.model import LaunchTemplate
from daemon.templates.revisions import KnobChange
from remediators.base import (
    MIB,
    Applicability,
    Cost,
    Lever,
    RemediationProposal,
    human_bytes,
    no,
    not_managed,
    require,
    yes,
)

ALLOC_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_FALLBACK_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
_MIN_SPLIT_MB = 32  # torch refuses max_split_size_mb at or below 20
GC_THRESHOLD = "0.6"


def parse_alloc_conf(text: str) -> list[tuple[str, str | None]]:
    """`key:value,key:value` as pairs in order; an item without a colon is kept as (item, None)."""
    items: list[tuple[str, str | None]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, colon, value = item.partition(":")
        items.append((key.strip(), value.strip()) if colon else (item, None))
    return items


def set_alloc_option(text: str, key: str, value: str) -> str:
    """The conf with `key` set to `value`, other options and their order preserved."""
    items = parse_alloc_conf(text)
    if any(existing == key for existing, _ in items):
        items = [(k, value if k == key else v) for k, v in items]
    else:
        items.append((key, value))
    return ",".join(k if v is None else f"{k}:{v}" for k, v in items)


def alloc_option(text: str, key: str) -> str | None:
    for existing, value in parse_alloc_conf(text):
        if existing == key:
            return value
    return None


def _env(template: LaunchTemplate) -> dict[str, str]:
    env_knob = template.dialect.knob_for(Role.ENV) or "env"
    value = template.knobs[env_knob]
    if not isinstance(value, tuple):
        return {}
    return {str(pair[0]): str(pair[1]) for pair in value if isinstance(pair, tuple)}


def _targets(env: dict[str, str]) -> tuple[str, ...]:
    present = tuple(name for name in ALLOC_VARIABLES if name in env)
    return present or (_FALLBACK_VARIABLE,)


def current_option(template: LaunchTemplate, key: str) -> str | None:
    """The option's value in effect: PYTORCH_ALLOC_CONF wins over the older name when both exist."""
    env = _env(template)
    for name in ALLOC_VARIABLES:
        if name in env:
            return alloc_option(env[name], key)
    return None


def env_change(template: LaunchTemplate, key: str, value: str) -> KnobChange:
    """A change of the env knob that sets one allocator option in every variable that carries it."""
    env = _env(template)
    updated = dict(env)
    for name in _targets(env):
        updated[name] = set_alloc_option(env.get(name, ""), key, value)
    env_knob = template.dialect.knob_for(Role.ENV) or "env"
    knobs: Knobs = template.knobs
    return KnobChange(env_knob, knobs[env_knob], tuple(sorted(updated.items())))


def _env_not_managed(template: LaunchTemplate) -> Applicability | None:
    """Every allocator lever moves the env knob: an imported script may not let it."""
    return not_managed(template, template.dialect.knob_for(Role.ENV) or "env")


def _async_backend(template: LaunchTemplate) -> bool:
    return current_option(template, "backend") == "cudaMallocAsync"


def _oom_numbers(diagnosis: Diagnosis) -> str:
    oom = diagnosis.oom
    if oom is None:
        return "no allocator numbers were printed"
    return (
        f"tried to allocate {human_bytes(oom.requested_bytes)} with "
        f"{human_bytes(oom.reserved_unallocated_bytes)} reserved but unallocated "
        f"and {human_bytes(oom.free_bytes)} free"
    )


@dataclass(frozen=True)
class ExpandableSegments:
    name: str = "allocator_expandable_segments"
    lever: Lever = Lever.ALLOCATOR

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        if (refused := _env_not_managed(template)) is not None:
            return refused
        if _async_backend(template):
            return no("the job uses backend:cudaMallocAsync; expandable segments are native-only")
        if (current_option(template, "expandable_segments") or "").lower() == "true":
            return no("expandable_segments:True is already set")
        return yes("expandable segments let reserved memory grow in place instead of splitting")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(env_change(template, "expandable_segments", "True"),),
            rationale=(
                f"Fragmentation: the allocator {_oom_numbers(diagnosis)}. Memory existed but not "
                "in one piece; expandable segments map more pages into the same segment."
            ),
            expected_effect="the reserved-but-unallocated gap shrinks; the same batch fits",
            cost=Cost((0, 2), "none to the model or the batch"),
            changes_science=False,
        )


def max_split_mb(requested_bytes: int) -> int:
    """Blocks of the largest failed request's size and above stay whole: round down to 32 MiB."""
    return max(_MIN_SPLIT_MB, requested_bytes // MIB // _MIN_SPLIT_MB * _MIN_SPLIT_MB)


@dataclass(frozen=True)
class MaxSplitSize:
    name: str = "allocator_max_split_size"
    lever: Lever = Lever.ALLOCATOR

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        requested = diagnosis.oom.requested_bytes if diagnosis.oom else None
        if requested is None:
            return no("the OOM message gave no request size to size max_split_size_mb from")
        if requested < _MIN_SPLIT_MB * MIB:
            return no(f"the failed request ({human_bytes(requested)}) is too small to matter")
        if (refused := _env_not_managed(template)) is not None:
            return refused
        if _async_backend(template):
            return no("the job uses backend:cudaMallocAsync; max_split_size_mb is native-only")
        if current_option(template, "max_split_size_mb") == str(max_split_mb(requested)):
            return no("max_split_size_mb is already set to that size")
        return yes(f"largest failed request {human_bytes(requested)}")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        requested = diagnosis.oom.requested_bytes if diagnosis.oom else None
        size = max_split_mb(requested or 0)
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(env_change(template, "max_split_size_mb", str(size)),),
            rationale=(
                f"Fragmentation: the allocator {_oom_numbers(diagnosis)}. Blocks of {size} MiB "
                "and above are no longer split for small tensors, so the recurring large request "
                "finds a whole block."
            ),
            expected_effect=f"requests near {size} MiB reuse cached blocks instead of failing",
            cost=Cost((0, 5), "more cudaMalloc calls for very large tensors"),
            changes_science=False,
        )


@dataclass(frozen=True)
class GarbageCollectionThreshold:
    name: str = "allocator_gc_threshold"
    lever: Lever = Lever.ALLOCATOR

    def applies(self, diagnosis: Diagnosis, template: LaunchTemplate) -> Applicability:
        if (refused := _env_not_managed(template)) is not None:
            return refused
        if _async_backend(template):
            return no("the job uses backend:cudaMallocAsync; the GC threshold is native-only")
        if current_option(template, "garbage_collection_threshold") is not None:
            return no("garbage_collection_threshold is already set")
        return yes("cached blocks can be reclaimed before the allocator gives up")

    def propose(self, diagnosis: Diagnosis, template: LaunchTemplate) -> RemediationProposal:
        require(self.applies(diagnosis, template))
        return RemediationProposal(
            remediator=self.name,
            lever=self.lever,
            changes=(env_change(template, "garbage_collection_threshold", GC_THRESHOLD),),
            rationale=(
                f"Fragmentation persists: the allocator {_oom_numbers(diagnosis)}. Above "
                f"{float(GC_THRESHOLD):.0%} of capacity the allocator frees unused cached blocks "
                "on its own, instead of failing."
            ),
            expected_effect="cached but unused blocks return to the pool before an OOM",
            cost=Cost((1, 5), "occasional reclaim pauses"),
            changes_science=False,
        )
