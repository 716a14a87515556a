"""Writing the RAM tier: every snapshot goes to this rank's RAM root first, then to storage.

One more ``PersistWorker`` thread per rank writes each snapshot into the rank's root under
the node's RAM-tier folder (``checkflow.memory.area``): every tensor the rank holds, with
the ``exact`` codec (bitwise, and the cheapest to write and read back), as a checkpoint of
world size 1 committed by the rank alone; its ``MANIFEST.json`` ``meta`` says which rank of
which world it is. When that write is done the same snapshot is handed to the storage
worker, which writes the rank's share as before (replicated tensors written by another
rank are skipped there). A step that is due only in the RAM tier releases its host buffers
right after the RAM write. A failed RAM write is logged and counted in ``RamTier.stats``;
the storage write goes on.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from checkflow.catalog import delete_steps, lineage_names
from checkflow.codec import CodecRules
from checkflow.memory.area import REPLICA, TIER, mark_jit, ram_dir_setting, rank_root
from checkflow.memory.copies import RamCopies
from checkflow.parallel import _compat
from checkflow.parallel.groups import rank_and_world
from checkflow.parallel.sharding import Shard, dtensor_box
from checkflow.state import FlatState
from checkflow.storage import Storage
from checkflow.write.commit import PersistReporter, RankResult, SingleProcessCommit
from checkflow.write.persist import PersistWorker
from checkflow.write.snapshot import Snapshot, Snapshotter
from checkflow.write.stats import CheckpointStats

if TYPE_CHECKING:
    from checkflow.config import CheckpointConfig

log = logging.getLogger(__name__)

Then = Callable[[Snapshot], "Future[int]"] | None


class RamTier:
    """This rank's RAM root and the thread that writes snapshots into it, in order.

    Args:
        ram_dir: the node's RAM-tier folder (``CHECKFLOW_RAM_DIR``).
        rank, world_size: this rank; recorded in each step's ``meta``.
        keep: newest RAM steps to retain (1 or 2: each is one more copy of the state).
        every: also a RAM-only checkpoint every this many steps (None: the storage
            checkpoints only).
        release: gives a snapshot's host buffers back (after a RAM-only step).
        on_persisted: called with each step's result once it is in the RAM tier.
        allow_pickle: as the ``Checkpointer``'s.
        replica: the job declared every rank's state the same (``jit=True``): each step's
            manifest says so, and another rank may restore from this copy
            (``checkflow.memory.jit``).
    """

    def __init__(
        self,
        ram_dir: str,
        *,
        rank: int,
        world_size: int,
        keep: int,
        every: int | None = None,
        release: Callable[[Snapshot], None],
        on_persisted: Callable[[RankResult], None] | None = None,
        allow_pickle: bool = False,
        replica: bool = False,
    ) -> None:
        self.ram_dir = ram_dir
        self.replica = replica
        self.jit_steps: set[int] = set()
        """Steps written just in time after a failure (``checkflow.memory.jit``)."""
        self.every = every
        self.rank = rank
        self.world_size = world_size
        self.root = rank_root(ram_dir, rank)
        self.storage = Storage(self.root)
        self.stats = CheckpointStats()
        self._release = release
        self._then: collections.deque[Then] = collections.deque()
        self._lock = threading.Lock()
        meta = {"tier": TIER, "rank": rank, "world_size": world_size}
        if replica:
            meta[REPLICA] = True
            mark_jit(ram_dir)
        self._worker = PersistWorker(
            self.storage,
            codecs=CodecRules("exact"),
            commit=SingleProcessCommit(),
            keep=keep,
            on_persisted=on_persisted,
            on_done=self._after_ram,
            meta=lambda: dict(meta),
            allow_pickle=allow_pickle,
            stats=self.stats,
        )

    def submit(self, snapshot: Snapshot, shards: dict[str, Any], then: Then) -> Future[int]:
        """Write ``snapshot`` (every tensor, placed by ``shards``) to the RAM tier, then call
        ``then`` with it (the storage write); returns ``then``'s future, or the RAM write's
        when ``then`` is None (a step due only in the RAM tier)."""
        relay: Future[int] = Future()
        with self._lock:
            self._then.append(None if then is None else lambda s: _chain(then(s), relay))
        ram = self._worker.submit(snapshot, full=True, shards=shards)
        return ram if then is None else relay

    def is_due(self, step: int) -> bool:
        """Whether ``step`` is a RAM-tier step (``ram_every``); the same on every rank."""
        return self.every is not None and step % self.every == 0

    def copies(self) -> RamCopies:
        """What this rank's RAM root holds, for a restore."""
        return RamCopies(
            self.ram_dir, rank=self.rank, world_size=self.world_size, replicas=self.replica
        )

    def forget_after(self, step: int) -> None:
        """Delete this rank's copies of the steps after ``step``: after a rollback to it they
        are the abandoned timeline's, and a restart must not take them for the newest."""
        names = lineage_names(self.storage)[1]  # no manifest read: a restore reads RAM fast
        delete_steps(self.storage, [s for s in names if s > step], names)

    def close(self) -> None:
        """Finish the RAM writes queued (each hands its snapshot on), then stop."""
        self._worker.close()

    def _after_ram(self, snapshot: Snapshot) -> None:
        with self._lock:
            then = self._then.popleft()
        if then is None:
            self._release(snapshot)
        else:
            then(snapshot)


def write_plan(
    tier: RamTier | None,
    before: dict[str, Any],
    flat: FlatState,
    shards: dict[str, Shard],
    global_names: set[str],
    *,
    storage: bool = True,
) -> TieredWrite:
    """Before the snapshot is taken: with a RAM tier, make it hold every tensor of this rank
    (``hold_everything``). Returns how to write it to the tiers (``storage`` False: to the
    RAM tier only)."""
    if tier is None:
        return TieredWrite(None, shards, shards, frozenset())
    every, skip = hold_everything(before, flat, shards, global_names)
    return TieredWrite(tier, every, shards, skip, storage)


@dataclass(frozen=True, slots=True)
class TieredWrite:
    """One snapshot's way through the tiers: all of it to RAM, this rank's share to storage."""

    tier: RamTier | None
    """None: no RAM tier, storage only."""
    every: dict[str, Shard]
    """Where each tensor of the snapshot sits (the RAM copy's shards)."""
    shards: dict[str, Shard]
    """The storage write's shards (this rank's share)."""
    skip: frozenset[str]
    """Tensors another rank writes to storage."""
    storage: bool = True
    """False: a step due in the RAM tier only."""

    def submit(self, snapshot: Snapshot, storage: PersistWorker) -> Future[int]:
        """Queue the RAM write, then the storage write; the storage write's future."""
        if self.tier is None:
            return storage.submit(snapshot, shards=self.shards)
        if not self.storage:
            return self.tier.submit(snapshot, self.every, None)
        return self.tier.submit(
            snapshot,
            self.every,
            lambda s: storage.submit(s, shards=self.shards, skip=self.skip),
        )


def _chain(source: Future[int], target: Future[int]) -> Future[int]:
    def copy(f: Future[int]) -> None:
        error = f.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(f.result())

    source.add_done_callback(copy)
    return target


def hold_everything(
    before: dict[str, Any],
    flat: FlatState,
    shards: dict[str, Shard],
    global_names: set[str],
) -> tuple[dict[str, Shard], frozenset[str]]:
    """Put back into ``flat.tensors`` the tensors this rank holds but another rank writes to
    storage (a DDP replica, a DTensor replica), so its RAM copy restores it alone.

    Args:
        before: ``flat.tensors`` as it was before ``prepare_snapshot`` reduced it.
        flat: the reduced state; gets the tensors back.
        shards: where each tensor this rank writes to storage sits.
        global_names: the state objects whose plain tensors are global.

    Returns:
        ``(shards of every tensor in flat.tensors, names that storage must skip)``.
    """
    if not shards and flat.tensors.keys() == before.keys():
        return shards, frozenset()  # one rank: it writes everything, whole
    every = dict(shards)
    extra: set[str] = set()
    for fqn, t in before.items():
        if fqn in flat.tensors or fqn.split(".", 1)[0] not in global_names:
            continue  # written by this rank anyway, or a per-rank value in the skeleton
        if _compat.is_dtensor(t):
            shape, offset = dtensor_box(t)
            if math.prod(shape) == 0:
                continue
            flat.tensors[fqn], every[fqn] = t.to_local(), Shard(tuple(t.shape), offset)
        else:
            flat.tensors[fqn], every[fqn] = t, Shard(tuple(t.shape), (0,) * t.dim())
        extra.add(fqn)
    return every, frozenset(extra)


def ram_tier(
    config: CheckpointConfig,
    group: Any,
    snapshots: Snapshotter,
    client: PersistReporter | None = None,
) -> RamTier | None:
    """The RAM tier of this rank of ``group`` in ``config.ram_dir``, else in
    ``CHECKFLOW_RAM_DIR``; None without one. With a coordinator ``client``, each step in
    the tier is reported to it (``tier="ram"``), so that its restore point may be a step
    only node memory holds."""
    ram_dir = ram_dir_setting(config.ram_dir)
    if ram_dir is None:
        return None
    rank, world_size = rank_and_world(group)

    def report(result: RankResult) -> None:
        if client is not None:
            jit = result.step in tier.jit_steps
            path = result.manifest_path
            client.report_persisted(
                result.step, result.nbytes, result.duration_s, path, TIER, jit=jit
            )

    tier = RamTier(
        ram_dir,
        rank=rank,
        world_size=world_size,
        keep=config.ram_keep,
        every=config.ram_every,
        release=snapshots.release,
        on_persisted=report,
        allow_pickle=config.allow_pickle,
        replica=config.jit,
    )
    log.info("RAM tier of rank %d: %s (keeps %d steps)", rank, tier.root, config.ram_keep)
    return tier
