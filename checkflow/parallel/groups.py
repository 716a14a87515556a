"""Which process group a checkpoint spans, and this rank's place in it."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def resolve_group(process_group: Any) -> Any:
    """The group to checkpoint: the one given, else the default group when initialized."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def rank_and_world(group: Any) -> tuple[int, int]:
    """(this rank, the group's size); (0, 1) without a group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
