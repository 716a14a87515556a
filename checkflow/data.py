"""A resumable, data-parallel sampler whose position survives a change of world size.

Like CheckFreq's resumable iterator, the order of an epoch is a deterministic permutation
(seeded by ``seed`` and the epoch), and the saved position is the *global* number of
samples the whole job consumed in the epoch, not a per-rank count. A job resumed on another
number of data-parallel ranks deals the rest of the same permutation out to its new ranks,
so over the epoch no sample is skipped and none is repeated.

Use it as a DataLoader's ``sampler`` and put it in the Checkpointer's state::

    sampler = ResumableSampler(len(dataset), seed=0)          # rank/world from torch.distributed
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    with Checkpointer(uri, state={"model": m, "optim": o, "data": sampler}) as ckpt:
        ckpt.restore()
        for epoch in range(sampler.epoch, epochs):
            for batch in loader: ...
            sampler.set_epoch(epoch + 1)

The position counts the indices this rank's iterator handed out, times the world size:
exact with ``num_workers=0`` (the loader takes indices as it builds each batch). Worker
processes prefetch indices ahead of training; for them, call ``sampler.consumed_batches(n,
batch_size)`` yourself or use a stateful loader (any object with ``state_dict`` /
``load_state_dict`` per rank is accepted by the Checkpointer).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

log = logging.getLogger(__name__)


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The permutation of one epoch: the same on every rank, in every run."""
    if not shuffle:
        return torch.arange(num_samples)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g)


def rank_share(
    order: torch.Tensor, consumed: int, rank: int, world_size: int, pad: bool
) -> torch.Tensor:
    """This rank's indices of what is left of ``order`` after ``consumed`` samples.

    The rest is dealt round-robin (sample ``consumed + i`` goes to rank ``i % world``). Every
    rank gets the same count: with ``pad`` the tail is filled from the start of the rest
    (as ``DistributedSampler`` does), without it the tail is dropped.
    """
    rest = order[consumed:]
    if pad:
        short = -len(rest) % world_size
        if short:
            rest = torch.cat([rest, rest[:short].repeat(short // max(1, len(rest)) + 1)[:short]])
    else:
        rest = rest[: len(rest) - len(rest) % world_size]
    return rest[rank::world_size]


class ResumableSampler(Sampler[int]):
    """Data-parallel sampler that resumes mid-epoch on any number of ranks.

    Args:
        num_samples: the dataset's length.
        seed: seeds the per-epoch permutation (must be the same on every rank).
        shuffle: permute each epoch; else the natural order.
        rank, world_size: this rank's place among the data-parallel ranks (default: the
            default process group, or 0 and 1).
        pad: repeat a few samples so that every rank gets as many (like
            ``DistributedSampler``); else drop the tail that does not divide evenly.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        pad: bool = True,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if rank is None or world_size is None:
            initialized = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if initialized else 0
            world_size = dist.get_world_size() if initialized else 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.pad = pad
        self.epoch = 0
        self.consumed = 0
        """Samples the whole job consumed in this epoch (all ranks together)."""

    def __len__(self) -> int:
        order = torch.empty(self.num_samples)
        return len(rank_share(order, self.consumed, 0, self.world_size, self.pad))

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.num_samples, self.epoch, self.seed, self.shuffle)
        share = rank_share(order, self.consumed, self.rank, self.world_size, self.pad)
        for index in share.tolist():
            # Every rank hands out one sample in the same round, so the job moved on by
            # world_size samples; capped, since padding may deal a few twice.
            self.consumed = min(self.num_samples, self.consumed + self.world_size)
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch = epoch
        self.consumed = 0

    def consumed_batches(self, batches: int, batch_size: int) -> None:
        """Set the position from batches trained on (for loaders that prefetch)."""
        self.consumed = min(self.num_samples, batches * batch_size * self.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the saved job stopped (it may have had another world size).

        Raises:
            ValueError: the dataset length, seed or shuffle differ from the saved ones.
        """
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the saved sampler had {key}={state[key]!r}, this one has "
                    f"{getattr(self, key)!r}: the order of the epoch would change"
                )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
