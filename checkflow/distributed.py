"""Process groups, cross-rank commit agreement and per-rank read plans.

Cross-rank agreement never uses the training group from a background thread: the commit
protocol counts finished ranks in the job's c10d store (a key per step, ``store.add``), so
a rank that dies leaves the count short and the step uncommitted, and nobody blocks.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from checkflow.persist import CommitProtocol, RankResult

if TYPE_CHECKING:
    from checkflow.restore import CheckpointReader

log = logging.getLogger(__name__)


def resolve_group(process_group: Any) -> Any:
    """The group to checkpoint: the one given, else the default group when initialized."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def rank_and_world(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class StoreCommit(CommitProtocol):
    """The last rank to finish a step commits it, counted in the c10d store."""

    def __init__(self, group: Any, uri: str) -> None:
        self.world_size = dist.get_world_size(group)
        key = hashlib.sha1(uri.encode()).hexdigest()[:12]
        base = dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"checkflow/{key}/", base)

    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        done = self.store.add(f"persisted/{step}", 1)
        return done == self.world_size


def read_state_dicts(reader: CheckpointReader, step: int, rank: int) -> dict[str, Any]:
    """``{name: state_dict}`` for ``rank``: its own objects when the step was saved with
    that rank, else rank 0's; tensors assembled whole."""
    world = reader.manifest(step).world_size
    return reader.state_dicts(step, rank if rank < world else 0)
