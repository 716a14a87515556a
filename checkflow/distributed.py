"""Process groups, cross-rank agreement, shard metadata and per-rank read plans.

Writing. Every tensor a rank saves is a *box* of a global tensor (``Shard``: global shape +
offset). A DTensor (FSDP2, tensor parallel, 2-D meshes) contributes its local shard at its
global offset; where its mesh replicates it, one replica writes it (chosen by a stable hash
of the name). A plain tensor of a module or optimizer is taken as replicated over the ranks
that hold it (DDP): one of them writes it, chosen by a plan every rank computes alike
(largest first, to the least-loaded holder), so no rank writes much more than its share.
Other plain tensors (RNG states, data loaders, schedulers) are per-rank: they stay inside
that rank's skeleton.

Agreement. Cross-rank agreement never uses the training group from a background thread.
At each checkpoint, on the training thread, every rank publishes a small record in the
job's c10d store (busy or not, its interval, a digest of what it holds) and reads
everyone's: all ranks then take or skip the checkpoint together, use rank 0's interval,
and compute the same write plan. The commit counts finished ranks in the store
(``store.add``), so a rank that dies leaves the count short and the step uncommitted, and
nobody blocks. A restore is agreed in the store as well: every rank loads the same step, the
newest one that every rank reads intact (``RestoreAgreement``).

Reading. ``read_state_dicts`` builds each rank's state from a global manifest: for every
tensor it reads only the chunks whose boxes overlap what this rank holds (a DTensor's local
shard, or the whole tensor), verifies each chunk's checksum over the whole chunk (it is the
unit that is checksummed, so sub-ranges are never read), and copies the overlap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist

from checkflow import manifest as mf
from checkflow.persist import CommitProtocol, RankResult
from checkflow.state import FlatState, TensorRef, iter_refs, unflatten

if TYPE_CHECKING:
    from checkflow.restore import CheckpointReader

log = logging.getLogger(__name__)


# -- groups ------------------------------------------------------------------------------
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


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


# -- boxes -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Shard:
    """Where a stored local tensor sits in its global tensor."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


_BOXES: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def dtensor_box(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of DTensor ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # Memoized: it runs on the training thread at every checkpoint, for every tensor.
    key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
    if key not in _BOXES:
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        _BOXES[key] = (tuple(shape), tuple(offset))
    return _BOXES[key]


def _replica_index(t: Any) -> tuple[int, int]:
    """(this rank's index among the ranks holding the same shard, how many hold it)."""
    from torch.distributed.tensor import Shard as ShardPlacement

    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    index, count = 0, 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, ShardPlacement):
            continue
        size = mesh.size(dim)
        index = index * size + (coord[dim] if coord is not None else 0)
        count *= size
    return index, count


def _writes_replica(fqn: str, t: Any) -> bool:
    index, count = _replica_index(t)
    return count == 1 or zlib.crc32(fqn.encode()) % count == index


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(slots=True)
class LocalState:
    """One rank's view of a flattened state before the write plan is known."""

    shards: dict[str, tuple[torch.Tensor, Shard]] = field(default_factory=dict)
    """DTensor local shards this rank writes (replica dedup already applied)."""
    replicated: dict[str, torch.Tensor] = field(default_factory=dict)
    """Plain module/optimizer tensors, replicated over the ranks that hold them."""

    @property
    def holdings(self) -> dict[str, int]:
        return {fqn: _nbytes(t) for fqn, t in self.replicated.items()}

    @property
    def shard_bytes(self) -> int:
        return sum(_nbytes(t) for t, _ in self.shards.values())


def split_state(flat: FlatState, global_names: set[str]) -> LocalState:
    """Sort ``flat``'s tensors into DTensor shards and replicated tensors; move per-rank
    tensors (every plain tensor not under a name in ``global_names``) into the skeleton.

    Mutates ``flat.skeleton`` (it is a private deep copy) and empties ``flat.tensors``.
    """
    local = LocalState()
    per_rank: dict[str, torch.Tensor] = {}
    t: Any
    for fqn, t in flat.tensors.items():
        if _is_dtensor(t):
            shape, offset = dtensor_box(t)
            if _writes_replica(fqn, t) and math.prod(shape) > 0:
                local.shards[fqn] = (t.to_local(), Shard(tuple(t.shape), offset))
        elif fqn.split(".", 1)[0] in global_names:
            local.replicated[fqn] = t
        else:
            # Cloned: the skeleton is pickled in the background while training goes on.
            per_rank[fqn] = t.detach().clone()
    if per_rank:
        flat.skeleton = _inline(flat.skeleton, per_rank)
    flat.tensors = {}
    return local


def _inline(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The skeleton with the refs named in ``tensors`` replaced by those tensors."""
    if isinstance(skeleton, TensorRef):
        return tensors.get(skeleton.fqn, skeleton)
    if isinstance(skeleton, Mapping):
        result: Any = type(skeleton)((k, _inline(v, tensors)) for k, v in skeleton.items())  # type: ignore[call-arg]
        if hasattr(skeleton, "_metadata"):
            result._metadata = skeleton._metadata
        return result
    if isinstance(skeleton, list):
        return [_inline(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple) and not hasattr(skeleton, "_fields"):
        return tuple(_inline(v, tensors) for v in skeleton)
    return skeleton


def global_state_names(state: Mapping[str, Any]) -> set[str]:
    """Names of state objects whose plain tensors are global (modules and optimizers)."""
    return {
        name
        for name, obj in state.items()
        if isinstance(obj, torch.nn.Module | torch.optim.Optimizer)
        or getattr(obj, "checkflow_global", False)
    }


# -- the write plan ----------------------------------------------------------------------
def balanced_writers(
    holders: Mapping[str, Iterable[int]],
    sizes: Mapping[str, int],
    base_load: Mapping[int, int] | None = None,
) -> dict[str, int]:
    """Pick one writer per replicated tensor: largest first, to its least-loaded holder.

    Pure and deterministic, so every rank computes the same plan from the same inputs.
    """
    load: dict[int, int] = dict(base_load or {})
    plan: dict[str, int] = {}
    for fqn in sorted(sizes, key=lambda f: (-sizes[f], f)):
        ranks = sorted(holders[fqn])
        writer = min(ranks, key=lambda r: (load.get(r, 0), r))
        plan[fqn] = writer
        load[writer] = load.get(writer, 0) + sizes[fqn]
    return plan


@dataclass(slots=True)
class Agreement:
    """What every rank decided together at one checkpoint."""

    go: bool
    """False when some rank is still persisting: every rank skips this checkpoint."""
    interval: int | None
    """Rank 0's checkpoint interval (``every="auto"``)."""
    writers: dict[str, int]
    """Writer rank of each replicated tensor."""


def _to_json(value: Any) -> bytes:
    # Records cross ranks through the store as JSON, never pickle: whoever can write to the
    # job's store must not be able to run code in every rank. Sorted keys: same bytes, same
    # digest on every rank.
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _from_json(data: bytes) -> Any:
    return json.loads(data)


class RankSync:
    """Cross-rank agreement of one ``Checkpointer`` through the job's c10d store.

    Construct it on every rank in the same order (it takes a generation number from the
    store, so several checkpointers in one job never read each other's keys). ``agree`` is
    called on the training thread by every rank at the same checkpoint; ``commit`` is the
    ``CommitProtocol`` used by the persist threads (store operations only, no collectives).
    """

    def __init__(self, group: Any, uri: str) -> None:
        self.rank, self.world_size = rank_and_world(group)
        key = hashlib.sha1(uri.encode()).hexdigest()[:12]
        base = dist.distributed_c10d._get_default_store()
        root = dist.PrefixStore(f"checkflow/{key}/", base)
        generation = (root.add("generation", 1) - 1) // self.world_size
        self.store = dist.PrefixStore(f"g{generation}/", root)
        self.commit = StoreCommit(self.store, self.world_size)
        self.restore = RestoreAgreement(self.store, self.rank, self.world_size)
        self._round = 0
        self.interval: int | None = None
        """Rank 0's interval as of the last agreement (``every="auto"``)."""
        self._known: dict[str, dict[str, int]] = {}
        self._plans: dict[tuple[Any, ...], dict[str, int]] = {}

    def agree(self, *, busy: bool, interval: int | None, local: LocalState) -> Agreement:
        """Publish this rank's record for the next checkpoint and read every rank's."""
        self._round += 1
        holdings = local.holdings
        encoded = _to_json(holdings)
        digest = hashlib.sha1(encoded).hexdigest()[:16]
        if digest not in self._known:
            self.store.set(f"holdings/{digest}", encoded)  # type: ignore[arg-type]
            self._known[digest] = holdings
        record = [busy, interval, digest, local.shard_bytes]
        self.store.set(f"round/{self._round}/{self.rank}", _to_json(record))  # type: ignore[arg-type]
        records = [
            _from_json(self.store.get(f"round/{self._round}/{r}")) for r in range(self.world_size)
        ]
        if self._round > 2 and self.rank == 0:
            # Old rounds are read by everyone by now (each rank read them to get here).
            for r in range(self.world_size):
                self.store.delete_key(f"round/{self._round - 2}/{r}")
        digests = tuple(rec[2] for rec in records)
        shard_bytes = tuple(rec[3] for rec in records)
        plan_key = (digests, shard_bytes)
        if plan_key not in self._plans:
            self._plans = {plan_key: self._plan(digests, shard_bytes)}
        return Agreement(
            go=not any(rec[0] for rec in records),
            interval=records[0][1],
            writers=self._plans[plan_key],
        )

    def _plan(self, digests: tuple[str, ...], shard_bytes: tuple[int, ...]) -> dict[str, int]:
        holders: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for rank, digest in enumerate(digests):
            if digest not in self._known:
                self._known[digest] = _from_json(self.store.get(f"holdings/{digest}"))
            for fqn, nbytes in self._known[digest].items():
                holders.setdefault(fqn, []).append(rank)
                sizes[fqn] = nbytes
        return balanced_writers(holders, sizes, dict(enumerate(shard_bytes)))


class StoreCommit(CommitProtocol):
    """The last rank to finish a step commits it, counted in the c10d store.

    That rank also deletes the step's counter: every rank has added to it by then and none
    reads it again, so a long job keeps no key per checkpoint in the store. A step that never
    commits (a rank died) leaves its counter, under a generation nobody reuses.
    """

    def __init__(self, store: Any, world_size: int) -> None:
        self.store = store
        self.world_size = world_size

    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        key = f"persisted/{step}"
        if self.store.add(key, 1) != self.world_size:
            return False
        self.store.delete_key(key)
        return True


# -- the step to restore -------------------------------------------------------------------
T = TypeVar("T")


class _Candidates(Generic[T]):
    """This rank's reads of candidate steps: each step is read at most once, and only the
    newest successful read is held (a restore keeps one state in memory, not one per step)."""

    def __init__(self, steps: Iterable[int], read: Callable[[int], T | None]) -> None:
        self.steps = sorted(set(steps), reverse=True)
        self._read = read
        self._bad: set[int] = set()
        self.held: tuple[int, T] | None = None

    def readable(self, step: int) -> bool:
        if self.held is not None and self.held[0] == step:
            return True
        if step in self._bad or step not in self.steps:
            return False
        value = self._read(step)
        if value is None:
            self._bad.add(step)
            return False
        self.held = (step, value)
        return True

    def newest_readable(self, bound: float) -> int | None:
        return next((s for s in self.steps if s <= bound and self.readable(s)), None)


def newest_readable(steps: Iterable[int], read: Callable[[int], T | None]) -> tuple[int, T] | None:
    """One rank alone: the newest of ``steps`` that ``read`` returns, and what it returned."""
    candidates = _Candidates(steps, read)
    step = candidates.newest_readable(math.inf)
    return None if step is None else candidates.held


class RestoreAgreement:
    """Every rank restores the same step: the newest one that every rank reads intact.

    One rank's files of the newest step may be damaged while the others read theirs; if each
    rank fell back on its own, the job would resume from a mix of two steps. Instead, in
    rounds through the job's c10d store: every rank proposes the newest step (at or below a
    bound) whose part it reads; all take the smallest proposal; the ranks that proposed a
    newer one read that step too, and every rank reports whether it could. When all could, it
    is the step. Otherwise the bound drops below it and the next round starts. The result is
    the newest step every rank reads: no rank proposes below it, and any step above it fails
    on some rank.

    ``agree`` runs on the training thread of every rank at the same call (like
    ``RankSync.agree``). Values are JSON. The last rank to finish deletes the call's keys.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._calls = 0

    def agree(self, steps: Iterable[int], read: Callable[[int], T | None]) -> tuple[int, T] | None:
        """The agreed step and this rank's read of it; None when some rank reads none of
        ``steps`` (every rank then starts from scratch).

        Args:
            steps: committed steps this rank may restore (newest first or in any order).
            read: reads this rank's part of a step; returns None when it cannot.
        """
        self._calls += 1
        prefix = f"restore/{self._calls}"
        candidates = _Candidates(steps, read)
        bound: float = math.inf
        rounds = 0
        while True:
            rounds += 1
            mine = candidates.newest_readable(bound)
            proposals = self._exchange(f"{prefix}/{rounds}/propose", -1 if mine is None else mine)
            agreed = min(proposals)
            if agreed < 0:
                self._clean_up(prefix, rounds)
                return None
            if all(self._exchange(f"{prefix}/{rounds}/ok", candidates.readable(agreed))):
                break
            bound = agreed - 1
        self._clean_up(prefix, rounds)
        if mine != agreed:
            log.warning(
                "step %s cannot be restored on every rank; restoring step %d, the newest step "
                "that every rank reads",
                mine,
                agreed,
            )
        assert candidates.held is not None and candidates.held[0] == agreed
        return candidates.held

    def _exchange(self, name: str, value: Any) -> list[Any]:
        """Publish ``value`` as this rank's ``name``; every rank's value, by rank."""
        self.store.set(f"{name}/{self.rank}", json.dumps(value))
        return [json.loads(self.store.get(f"{name}/{r}")) for r in range(self.world_size)]

    def _clean_up(self, prefix: str, rounds: int) -> None:
        # Each rank counts itself out once it has read all it needs; the last one deletes
        # (deleting a key that a final round never wrote is a no-op).
        if self.store.add(f"{prefix}/done", 1) != self.world_size:
            return
        for n in range(1, rounds + 1):
            for kind in ("propose", "ok"):
                for r in range(self.world_size):
                    self.store.delete_key(f"{prefix}/{n}/{kind}/{r}")
        self.store.delete_key(f"{prefix}/done")


def restore_point(
    steps: Iterable[int], read: Callable[[int], T | None], sync: RankSync | None
) -> tuple[int, T] | None:
    """The step to restore and this rank's read of it: the newest one that reads, agreed by
    every rank when there are several (``RestoreAgreement``); None when none reads."""
    if sync is None:
        return newest_readable(steps, read)
    return sync.restore.agree(steps, read)


def snapshot_inputs(
    flat: FlatState, local: LocalState, writers: Mapping[str, int], rank: int
) -> dict[str, Shard]:
    """Fill ``flat.tensors`` with what this rank writes; returns their shards."""
    shards: dict[str, Shard] = {}
    for fqn, (t, shard) in local.shards.items():
        flat.tensors[fqn] = t
        shards[fqn] = shard
    for fqn, t in local.replicated.items():
        if writers.get(fqn, rank) == rank:
            flat.tensors[fqn] = t
            shards[fqn] = Shard(tuple(t.shape), (0,) * t.dim())
    return shards


def local_pointers(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage pointers of the local shards of DTensor parameters and optimizer state.

    A DTensor has no storage of its own; its local tensor does, and that is what a snapshot
    copies, so the optimizer hook must protect it.
    """
    out: set[int] = set()

    def add(t: Any) -> None:
        if _is_dtensor(t):
            out.add(t.to_local().untyped_storage().data_ptr())

    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
        for per_param in opt.state.values():
            for v in per_param.values():
                add(v)
    return out


# -- reading -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Layout:
    """How this rank holds a tensor: a DTensor's mesh and placements."""

    mesh: Any
    placements: tuple[Any, ...]
    global_shape: tuple[int, ...]


def live_layouts(state: Mapping[str, Any]) -> dict[str, Layout]:
    """``{fqn: Layout}`` of every DTensor in the live state, and of the optimizer state
    that does not exist yet but will be sharded like its parameter (``optim.state.3``)."""
    from checkflow.state import flatten

    out: dict[str, Layout] = {}
    t: Any
    for fqn, t in flatten(state, allow_pickle=True).tensors.items():  # nothing is stored
        if _is_dtensor(t):
            out[fqn] = Layout(t.device_mesh, tuple(t.placements), tuple(t.shape))
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        index = 0
        for group in obj.param_groups:
            for p in group["params"]:
                if _is_dtensor(p):
                    out[f"{name}.state.{index}"] = Layout(
                        p.device_mesh, tuple(p.placements), tuple(p.shape)
                    )
                index += 1
    return out


def _layout_for(fqn: str, shape: list[int], layouts: Mapping[str, Layout]) -> Layout | None:
    layout = layouts.get(fqn)
    if layout is None:
        # Optimizer state (``optim.state.3.exp_avg``) follows its parameter's layout when
        # it has the parameter's shape; scalars such as ``step`` stay plain.
        parent = fqn.rsplit(".", 1)[0]
        layout = layouts.get(parent)
    if layout is None or list(layout.global_shape) != list(shape):
        return None
    return layout


def chunk_index(reader: CheckpointReader, step: int) -> dict[str, list[tuple[int, mf.ChunkEntry]]]:
    """Every stored box of ``step``, by tensor name: ``{fqn: [(rank, chunk), ...]}``."""
    index: dict[str, list[tuple[int, mf.ChunkEntry]]] = {}
    for rm in reader.rank_manifests(step):
        for c in rm.chunks:
            index.setdefault(c.fqn, []).append((rm.rank, c))
    return index


def read_box(
    reader: CheckpointReader,
    step: int,
    parts: list[tuple[int, mf.ChunkEntry]],
    offset: tuple[int, ...],
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The box ``offset``/``shape`` of a global tensor, from the chunks that overlap it.

    Raises:
        CorruptCheckpointError: the stored chunks do not cover the box.
    """
    from checkflow.codec.base import dtype_from_name
    from checkflow.restore import CorruptCheckpointError

    first = parts[0][1]
    if not first.global_shape:
        return reader.chunk(step, parts[0][0], first)
    if len(parts) == 1 and tuple(first.shape) == shape and tuple(first.offset) == offset:
        return reader.chunk(step, parts[0][0], first)
    out = torch.empty(shape, dtype=dtype_from_name(first.dtype))
    covered = 0
    for rank, c in parts:
        lo = [max(a, b) for a, b in zip(c.offset, offset, strict=True)]
        hi = [
            min(a + n, b + m) for a, n, b, m in zip(c.offset, c.shape, offset, shape, strict=True)
        ]
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            continue  # no overlap: this chunk is never read
        data = reader.chunk(step, rank, c)
        src, dst = data, out
        for dim, (a, b) in enumerate(zip(lo, hi, strict=True)):
            src = src.narrow(dim, a - c.offset[dim], b - a)
            dst = dst.narrow(dim, a - offset[dim], b - a)
        dst.copy_(src)
        covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
    if covered < out.numel():
        raise CorruptCheckpointError(
            step, parts[0][0], first.fqn, first.file, f"chunks cover {covered} of {out.numel()}"
        )
    return out


def _read_tensor(
    reader: CheckpointReader,
    step: int,
    parts: list[tuple[int, mf.ChunkEntry]],
    layout: Layout | None,
) -> torch.Tensor:
    gshape = tuple(parts[0][1].global_shape)
    if layout is None:
        return read_box(reader, step, parts, (0,) * len(gshape), gshape)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(gshape, layout.mesh, layout.placements)
    local = read_box(reader, step, parts, tuple(offset), tuple(shape))
    return DTensor.from_local(
        local,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=torch.Size(gshape),
        stride=torch.empty(gshape, device="meta").stride(),
    )


def read_state_dicts(
    reader: CheckpointReader,
    step: int,
    rank: int,
    live: LiveState | None = None,
) -> dict[str, Any]:
    """``{name: state_dict}`` for ``rank`` of the job restoring now.

    Per-rank values (RNG, data position, schedulers) come from the same rank of the saved
    job when it had one, else from rank 0. Tensors come from every saved rank's chunks:
    whole tensors, or the local shard of a DTensor laid out as in ``live`` (a DTensor is
    returned). ``live.module_keys`` lets a pipeline stage take its modules from whichever
    saved stage held them, under their global names.
    """
    world = reader.manifest(step).world_size
    source = rank if rank < world else 0
    skeleton = reader.skeleton(step, source)
    layouts = live.layouts if live is not None else {}
    for name, keys in (live.module_keys if live is not None else {}).items():
        held = skeleton.get(name)
        if isinstance(held, Mapping) and keys != held.keys():
            skeleton[name] = _gather_module(reader, step, world, name, keys)
    index = chunk_index(reader, step)
    tensors: dict[str, torch.Tensor] = {}
    for fqn in iter_refs(skeleton):
        if fqn not in index:
            raise KeyError(f"step {step} has no tensor {fqn!r}")
        parts = index[fqn]
        layout = _layout_for(fqn, parts[0][1].global_shape, layouts)
        tensors[fqn] = _read_tensor(reader, step, parts, layout)
    return unflatten(skeleton, tensors)


def _gather_module(
    reader: CheckpointReader, step: int, world: int, name: str, keys: set[str]
) -> dict[str, Any]:
    """A module's state_dict entries ``keys``, collected from every saved rank (stages)."""
    out: dict[str, Any] = OrderedDict()
    metadata: dict[str, Any] = {}
    for r in range(world):
        held = reader.skeleton(step, r).get(name)
        if not isinstance(held, Mapping):
            continue
        for k, v in held.items():
            if k in keys:
                out.setdefault(k, v)
        metadata.update(getattr(held, "_metadata", {}))
    if missing := keys - out.keys():
        raise KeyError(f"step {step} has no {name}.{sorted(missing)[0]} on any rank")
    out._metadata = metadata  # type: ignore[attr-defined]
    return out


__all__ = [
    "Agreement",
    "Layout",
    "LocalState",
    "ModelState",
    "RankSync",
    "RestoreAgreement",
    "Shard",
    "StoreCommit",
    "balanced_writers",
    "live_layouts",
    "read_state_dicts",
    "restore_point",
]


# -- the training-thread side of a checkpoint ---------------------------------------------
def prepare_snapshot(
    flat: FlatState,
    global_names: set[str],
    sync: RankSync | None,
    *,
    busy: bool,
    interval: int | None,
    rank: int,
) -> dict[str, Shard] | None:
    """Reduce ``flat`` to what this rank writes; returns its shards, or None to skip.

    Without a ``sync`` (one rank) and without DTensors, ``flat`` is left as it is. With a
    ``sync`` every rank must call this at the same checkpoint: they skip together when any
    of them is still persisting (``busy``), else each keeps its share.
    """
    if sync is None and not any(_is_dtensor(t) for t in flat.tensors.values()):
        return {}
    local = split_state(flat, global_names if sync is not None else set(flat.skeleton))
    writers: dict[str, int] = {}
    if sync is not None:
        agreed = sync.agree(busy=busy, interval=interval, local=local)
        sync.interval = agreed.interval
        if not agreed.go:
            return None
        writers = agreed.writers
    return snapshot_inputs(flat, local, writers, rank)


@dataclass(slots=True)
class LiveState:
    """What a restore needs to know about the live state objects of this rank."""

    layouts: dict[str, Layout]
    module_keys: dict[str, set[str]]


def live_state(state: Mapping[str, Any]) -> LiveState:
    return LiveState(
        layouts=live_layouts(state),
        module_keys={
            name: set(obj.state_dict().keys())
            for name, obj in state.items()
            if isinstance(obj, torch.nn.Module) or getattr(obj, "checkflow_global", False)
        },
    )


# -- pipeline stages ------------------------------------------------------------------------
class ModelState:
    """A model (or pipeline stage) and its optimizer as one state object keyed by global
    parameter names, so that a restore into a different stage split finds every entry.

    ``optimizer.state_dict()`` numbers parameters per optimizer, which changes with the split;
    this uses ``torch.distributed.checkpoint.state_dict`` to key optimizer state by the
    parameter's name instead. Give each stage's module its global names (``layers.3``).

    Args:
        model: the module (a stage holding only some layers is fine).
        optimizer: its optimizer, if any.
    """

    checkflow_global = True
    """Its tensors are global (sharded or replicated), not per-rank."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.optimizer = optimizer

    @staticmethod
    def _options() -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = self._options()
        model = get_model_state_dict(self.model, options=opts)
        out: dict[str, Any] = {f"model.{k}": v for k, v in model.items()}
        if self.optimizer is not None:
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
            out.update({f"optim.{k}": v for k, v in optim.items()})
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = self._options()
        model = {k[6:]: v for k, v in state_dict.items() if k.startswith("model.")}
        set_model_state_dict(self.model, model, options=opts)
        if self.optimizer is not None:
            optim = {k[6:]: v for k, v in state_dict.items() if k.startswith("optim.")}
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=opts)


def consolidated_state_dicts(reader: CheckpointReader, step: int) -> dict[str, Any]:
    """``{name: state_dict}`` of the whole job with full tensors: rank 0's objects, each
    completed with the entries only other ranks saved (pipeline stages)."""
    world = reader.manifest(step).world_size
    skeleton = reader.skeleton(step, 0)
    for r in range(1, world):
        for name, value in reader.skeleton(step, r).items():
            mine = skeleton.get(name)
            if isinstance(mine, Mapping) and isinstance(value, Mapping):
                extra = {k: v for k, v in value.items() if k not in mine}
                if extra:
                    mine.update(extra)  # type: ignore[attr-defined]
            elif name not in skeleton:
                skeleton[name] = value
    return unflatten(skeleton, reader.tensors(step, set(iter_refs(skeleton))))
