"""Where each saved tensor sits in its global tensor, and which rank writes it.

Every tensor a rank saves is a *box* of a global tensor (``Shard``: global shape + offset).
A DTensor (FSDP2, tensor parallel, 2-D meshes) contributes its local shard at its global
offset; where its mesh replicates it, one replica writes it (chosen by a stable hash of the
name). A plain tensor of a module or optimizer is taken as replicated over the ranks that
hold it (DDP): one of them writes it, chosen by a plan every rank computes alike (largest
first, to the least-loaded holder), so no rank writes much more than its share. Other plain
tensors (RNG states, data loaders, schedulers) are per-rank: they stay inside that rank's
skeleton.

A restore lays tensors out the same way: ``Layout`` is how this rank holds a DTensor, and
``layout_box`` the box of the global tensor it must read.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from checkflow import tree, xla
from checkflow.parallel import _compat
from checkflow.state import FlatState, TensorRef


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a stored local tensor sits in its global tensor."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """How this rank holds a tensor: a DTensor's mesh and placements."""

    mesh: Any
    placements: tuple[Any, ...]
    global_shape: tuple[int, ...]


def layout_box(layout: Layout, global_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """(offset, shape) of this rank's box of a ``global_shape`` tensor laid out as ``layout``."""
    shape, offset = _compat.local_shape_and_offset(global_shape, layout.mesh, layout.placements)
    return offset, shape


def to_dtensor(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> Any:
    """The DTensor whose shard on this rank is ``local``, laid out as ``layout``."""
    return _compat.dtensor_from_local(local, layout.mesh, layout.placements, global_shape)


@dataclass(slots=True)
class LiveState:
    """What a restore needs to know about the live state objects of this rank."""

    layouts: dict[str, Layout] = field(default_factory=dict)
    """``{fqn: Layout}`` of every DTensor, and of optimizer state to come (``live_layouts``)."""
    module_keys: dict[str, set[str]] = field(default_factory=dict)
    """The state_dict keys of each module: a pipeline stage holds only some of them."""
    xla_layouts: dict[str, xla.XlaLayout] = field(default_factory=dict)
    """``{fqn: XlaLayout}`` of every SPMD-sharded XLA tensor, and of optimizer state to come."""
    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    """``{fqn: tensor}`` of the live whole tensors (unsharded XLA ones, contiguous CPU ones)
    that a restore copies into as it reads them (``live_targets``)."""
    landed: set[int] = field(default_factory=set)
    """Steps whose read began to copy into ``targets``: a failed read of one of them may
    have left some of its values in the live tensors."""

    def layout_for(self, fqn: str, shape: Iterable[int]) -> Layout | None:
        """How this rank holds tensor ``fqn`` of global ``shape``; None when whole."""
        return _layout_for(self.layouts, fqn, shape)

    def xla_layout_for(self, fqn: str, shape: Iterable[int]) -> xla.XlaLayout | None:
        """How this process holds SPMD tensor ``fqn`` of global ``shape``; None when it
        is not one."""
        return _layout_for(self.xla_layouts, fqn, shape)

    def target_for(self, fqn: str, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor | None:
        """The live tensor that tensor ``fqn`` is read into, when it has its shape and
        dtype; None when it is read into new memory (then ``load_state_dict`` copies it)."""
        t = self.targets.get(fqn)
        if t is None or list(t.shape) != list(shape) or t.dtype != dtype:
            return None
        return t

    @property
    def on_xla(self) -> bool:
        """True when a restore lands tensors on XLA devices (their host copies are transient)."""
        return bool(self.xla_layouts) or any(xla.is_xla(t) for t in self.targets.values())


def _layout_for(layouts: Mapping[str, Any], fqn: str, shape: Iterable[int]) -> Any:
    layout = layouts.get(fqn)
    if layout is None:
        # Optimizer state (``optim.state.3.exp_avg``) follows its parameter's layout when
        # it has the parameter's shape; scalars such as ``step`` stay plain.
        layout = layouts.get(fqn.rsplit(".", 1)[0])
    if layout is None or list(layout.global_shape) != list(shape):
        return None
    return layout


_BOXES: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def dtensor_box(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of DTensor ``t``."""
    # Memoized: it runs on the training thread at every checkpoint, for every tensor.
    key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
    if key not in _BOXES:
        _BOXES[key] = _compat.local_shape_and_offset(t.shape, t.device_mesh, t.placements)
    return _BOXES[key]


def _replica_index(t: Any) -> tuple[int, int]:
    """(this rank's index among the ranks holding the same shard, how many hold it)."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    index, count = 0, 1
    for dim, placement in enumerate(t.placements):
        if _compat.is_shard_placement(placement):
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
        if _compat.is_dtensor(t):
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

    def leaf(v: Any, _path: str) -> Any:
        return tensors.get(v.fqn, v) if isinstance(v, TensorRef) else v

    return tree.map_tree(skeleton, leaf, keep_type=True)


def global_state_names(state: Mapping[str, Any]) -> set[str]:
    """Names of state objects whose plain tensors are global (modules and optimizers)."""
    return {
        name
        for name, obj in state.items()
        if isinstance(obj, torch.nn.Module | torch.optim.Optimizer)
        or getattr(obj, "checkflow_global", False)
    }


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
