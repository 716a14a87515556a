"""Reading the RAM tier back: which steps this rank's RAM root holds, and its state of one.

A step counts only when its ``MANIFEST.json`` is there (the same commit rule as storage)
and says it is this rank of a job of this world size: after a restart on another world
size, or with other ranks on this node, the copies do not apply and storage is read.
Every chunk is checked against its xxh3 checksum, as from storage.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from checkflow.catalog import committed_steps
from checkflow.memory.area import TIER, rank_root
from checkflow.parallel.sharding import LiveState
from checkflow.read.reader import CheckpointReader
from checkflow.read.state_dicts import read_state_dicts
from checkflow.storage import Storage

log = logging.getLogger(__name__)


class RamCopies:
    """The checkpoints of ``rank`` in a node's RAM-tier folder ``ram_dir``."""

    def __init__(self, ram_dir: str, *, rank: int, world_size: int) -> None:
        self.root = rank_root(ram_dir, rank)
        self.rank = rank
        self.world_size = world_size
        self.storage = Storage(self.root)

    def steps(self) -> set[int]:
        """Committed steps that are this rank's, of a job of this world size."""
        if not os.path.isdir(self.root):
            return set()
        return {
            step
            for step, manifest in committed_steps(self.storage).items()
            if manifest.meta.get("tier") == TIER
            and manifest.meta.get("rank") == self.rank
            and manifest.meta.get("world_size") == self.world_size
        }

    def read(self, step: int, live: LiveState, *, trust: bool) -> dict[str, Any]:
        """This rank's state dicts of ``step``, every chunk verified.

        Raises:
            One of ``RESTORE_ERRORS``: the copy is missing, damaged or does not decode.
        """
        reader = CheckpointReader(self.storage, trust=trust)
        return read_state_dicts(reader, step, 0, live)
