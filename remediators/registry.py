"""Every lever slurm-medic has, in one explicit list; the planner looks them up by name."""

from __future__ import annotations

from collections.abc import Mapping

from remediators.allocator import ExpandableSegments, GarbageCollectionThreshold, MaxSplitSize
from remediators.base import Remediator
from remediators.eval_batch import EvalAccumulation, EvalBatchDown, GenerationCap
from remediators.micro_batch import MicroBatchDown
from remediators.nodes import DrainAndExclude, ExcludeNode
from remediators.recompute import FullRecompute, SelectiveRecompute
from remediators.sequence import SequenceLengthDown
from remediators.sharding import EightBitOptimizer, ShardingUp
from remediators.workers import WorkersDown

REMEDIATORS: tuple[Remediator, ...] = (
    ExpandableSegments(),
    MaxSplitSize(),
    GarbageCollectionThreshold(),
    MicroBatchDown(),
    SelectiveRecompute(),
    FullRecompute(),
    ShardingUp(),
    EightBitOptimizer(),
    EvalBatchDown(),
    EvalAccumulation(),
    GenerationCap(),
    WorkersDown(),
    SequenceLengthDown(),
    ExcludeNode(),
    DrainAndExclude(),
)

BY_NAME: Mapping[str, Remediator] = {remediator.name: remediator for remediator in REMEDIATORS}
