"""Which process group a checkpoint spans, and this rank's place in it."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from checkflow import claims


def resolve_group(process_group: Any) -> Any:
    """The group to checkpoint: the one given, else the default group when initialized."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def checkpoint_group(process_group: Any) -> tuple[Any, int, int]:
    """The group to checkpoint (:func:`resolve_group`), this rank in it and its size.

    Under ``checkflow run`` it also tells the agent the global rank and world size this
    process runs as (:mod:`checkflow.claims`), whatever group is checkpointed: the agent
    stops a job whose workers do not form the world it launched.
    """
    group = resolve_group(process_group)
    claims.write_claim(*rank_and_world(resolve_group(None)))
    return (group, *rank_and_world(group))


def rank_and_world(group: Any) -> tuple[int, int]:
    """(this rank, the group's size); (0, 1) without a group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
