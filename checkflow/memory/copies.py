"""Reading the RAM tier back: which steps this rank's RAM root holds, and its state of one.

A step counts only when its ``MANIFEST.json`` is there (the same commit rule as storage)
and says it is this rank of a job of this world size: after a restart on another world
size, or with other ranks on this node, the copies do not apply and storage is read.
A rank of a job that declared its state replicated (``Checkpointer(jit=True)``) also takes,
for a step its own root lacks, another rank's copy of it that says ``replica`` (written
just in time by a survivor: ``checkflow.memory.jit``); never a copy that does not say so.

Every chunk is checked against its xxh3 checksum, as from storage. The files are read
through ``mmap`` (``MappedStorage``): on tmpfs a chunk is then a view of the memory that
holds it, not a copy, and an ``exact`` tensor decodes to a view of it; the only copy left
is ``load_state_dict``'s into the live tensors.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from checkflow.catalog import committed_steps
from checkflow.memory.area import REPLICA, TIER, rank_root
from checkflow.parallel.sharding import LiveState
from checkflow.read.reader import CheckpointReader
from checkflow.read.state_dicts import read_state_dicts
from checkflow.storage import Storage

log = logging.getLogger(__name__)


class RamCopies:
    """The checkpoints of ``rank`` in a node's RAM-tier folder ``ram_dir``; with
    ``replicas``, the other ranks' replica copies there too, for the steps ``rank`` lacks."""

    def __init__(self, ram_dir: str, *, rank: int, world_size: int, replicas: bool = False) -> None:
        self.ram_dir = ram_dir
        self.root = rank_root(ram_dir, rank)
        self.rank = rank
        self.world_size = world_size
        self.replicas = replicas
        self.storage = MappedStorage(self.root)
        self._stand_ins: dict[int, MappedStorage] = {}

    def steps(self) -> set[int]:
        """Committed steps that are this rank's, of a job of this world size (and, with
        ``replicas``, those another rank's replica copy holds)."""
        own = _rank_steps(self.root, self.storage, self.rank, self.world_size)
        if self.replicas:
            self._stand_ins = {
                step: storage
                for step, storage in replica_steps(self.ram_dir, self.world_size).items()
                if step not in own
            }
        return own | set(self._stand_ins)

    def read(self, step: int, live: LiveState, *, trust: bool) -> dict[str, Any]:
        """This rank's state dicts of ``step``, every chunk verified.

        Raises:
            One of ``RESTORE_ERRORS``: the copy is missing, damaged or does not decode.
        """
        storage = self._stand_ins.get(step, self.storage)
        if storage is not self.storage:
            log.warning(
                "rank %d restores step %d from %s: a replica's copy (jit=True)",
                self.rank,
                step,
                storage.uri,
            )
        reader = CheckpointReader(storage, trust=trust, complete=False)
        return read_state_dicts(reader, step, 0, live)


def _rank_steps(root: str, storage: Storage, rank: int, world_size: int) -> set[int]:
    """Committed steps of the rank root ``root`` that are ``rank``'s, of a job of
    ``world_size``."""
    if not os.path.isdir(root):
        return set()
    return {
        step
        for step, manifest in committed_steps(storage).items()
        if manifest.meta.get("tier") == TIER
        and manifest.meta.get("rank") == rank
        and manifest.meta.get("world_size") == world_size
    }


def replica_steps(ram_dir: str, world_size: int) -> dict[int, MappedStorage]:
    """``{step: the rank root holding it}`` of every committed copy in ``ram_dir`` whose
    rank declared it a replica (``meta["replica"]``), of a job of ``world_size``."""
    found: dict[int, MappedStorage] = {}
    for rank in range(world_size):
        root = rank_root(ram_dir, rank)
        if not os.path.isdir(root):
            continue
        storage = MappedStorage(root)
        for step, manifest in committed_steps(storage).items():
            meta = manifest.meta
            if (
                meta.get(REPLICA) is True
                and meta.get("tier") == TIER
                and meta.get("rank") == rank
                and meta.get("world_size") == world_size
            ):
                found.setdefault(step, storage)
    return found


class MappedStorage(Storage):
    """A local checkpoint root whose reads of chunks and objects, small ones included, are
    ``mmap`` views instead of copies (:mod:`checkflow.storage.mapped`); on tmpfs such a view
    is the memory that holds the copy. Manifests (whole-file reads) are still read."""

    def __init__(self, uri: str, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        self.map_min_bytes = 1
