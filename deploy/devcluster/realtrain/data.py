"""The real run's data and the tiny model's shape: tokens made on the spot, nothing downloaded.

The modelled 1.3B shape stays the model of GPU memory (`emulation.model`); the real network
(`realtrain.model` for torchrun, transformers' GPT-2 in `realtrain.hf` for the Trainer) only
has to be a real one that a 2-core machine trains in milliseconds per step, so its frames and
checkpoints are real. Imports torch only: the torchrun dialect's ranks never load transformers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import Dataset, Sampler

TINY_VOCAB = 256
TINY_SEQ = 32
TINY_LAYERS = 2
TINY_HIDDEN = 64
TINY_HEADS = 4
MIB = 1 << 20
# Each dataloader worker's own resident host memory (REALTRAIN_WORKER_MIB), in MiB. None by
# default: several test runs share one machine; a host-RAM run says how much (96 in the tests).
DEFAULT_WORKER_MIB = 0


class SyntheticTokens(Dataset[dict[str, torch.Tensor]]):
    """Counting sequences mod the vocabulary from a seeded start and stride: learnable, so the
    loss really falls; `labels` equal `input_ids` (the model shifts them itself). No padding:
    the attention mask is all ones, given so that transformers need not guess it."""

    def __init__(self, size: int, seed: int = 0, seq_len: int = TINY_SEQ) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, TINY_VOCAB, (size, 1), generator=generator)
        strides = torch.randint(1, 4, (size, 1), generator=generator)
        self.tokens = (starts + strides * torch.arange(seq_len)) % TINY_VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()}


class StepSampler(Sampler[int]):
    """This rank's samples of one optimizer step: a seeded shuffle per step, split by rank.

    Indexed by step, so a resumed run sees the very samples it would have seen.
    """

    def __init__(self, size: int, per_rank: int, rank: int, world_size: int, seed: int) -> None:
        self.size = size
        self.per_rank = per_rank
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step = 1

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.step)
        order = torch.randperm(self.size, generator=generator).tolist()
        needed = self.per_rank * self.world_size
        order = (order * (needed // self.size + 1))[:needed]
        return iter(order[self.rank * self.per_rank : (self.rank + 1) * self.per_rank])

    def __len__(self) -> int:
        return self.per_rank


class WorkerBallast:
    """A dataloader worker's own host memory: `mib` MiB really written, held for its life.

    Stands in for what real workers hold (decoded samples, prefetch queues, a tokenizer's
    caches), so a job sized below its workers is killed by Slurm's memory cgroup.
    """

    def __init__(self, mib: int) -> None:
        self.mib = mib
        self.held: list[torch.Tensor] = []

    def __call__(self, worker_id: int) -> None:
        if self.mib > 0:
            # torch.ones writes every page, so the memory is resident, not just reserved.
            self.held.append(torch.ones(self.mib * MIB, dtype=torch.uint8))


def worker_mib_from_env(env: Mapping[str, str]) -> int:
    """REALTRAIN_WORKER_MIB, the MiB each dataloader worker holds (default DEFAULT_WORKER_MIB)."""
    text = env.get("REALTRAIN_WORKER_MIB")
    if text is None:
        return DEFAULT_WORKER_MIB
    if not text.isdigit():
        raise ValueError(f"REALTRAIN_WORKER_MIB={text!r} is not a whole number of MiB")
    return int(text)
