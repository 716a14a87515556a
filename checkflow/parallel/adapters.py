"""Adapters between the live state objects of a rank and a checkpoint.

On the training thread, ``prepare_snapshot`` reduces a flattened state to what this rank
writes (agreed with the other ranks), and ``local_pointers`` names the storages an
optimizer step must not overwrite while they are copied. For a restore, ``live_state``
records how this rank holds its tensors (DTensor layouts, a pipeline stage's module
keys). ``ModelState`` is the user-facing adapter that keys optimizer state by parameter
name, so a restore into another pipeline split finds every entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from checkflow import xla
from checkflow.parallel import _compat
from checkflow.parallel.agreement import RankSync
from checkflow.parallel.sharding import Layout, LiveState, Shard, snapshot_inputs, split_state
from checkflow.state import FlatState, flatten


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
    if sync is None and not any(_compat.is_dtensor(t) for t in flat.tensors.values()):
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


def local_pointers(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage pointers of the local shards of DTensor parameters and optimizer state.

    A DTensor has no storage of its own; its local tensor does, and that is what a snapshot
    copies, so the optimizer hook must protect it.
    """
    out: set[int] = set()

    def add(t: Any) -> None:
        if _compat.is_dtensor(t):
            out.add(t.to_local().untyped_storage().data_ptr())

    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
        for per_param in opt.state.values():
            for v in per_param.values():
                add(v)
    return out


def live_state(state: Mapping[str, Any]) -> LiveState:
    return LiveState(
        layouts=live_layouts(state),
        module_keys={
            name: set(obj.state_dict().keys())
            for name, obj in state.items()
            if isinstance(obj, torch.nn.Module) or getattr(obj, "checkflow_global", False)
        },
        xla_layouts=live_xla_layouts(state),
        targets=live_targets(state),
    )


def live_layouts(state: Mapping[str, Any]) -> dict[str, Layout]:
    """``{fqn: Layout}`` of every DTensor in the live state, and of the optimizer state
    that does not exist yet but will be sharded like its parameter (``optim.state.3``)."""
    out: dict[str, Layout] = {}
    t: Any
    for fqn, t in flatten(state, allow_pickle=True).tensors.items():  # nothing is stored
        if _compat.is_dtensor(t):
            out[fqn] = Layout(t.device_mesh, tuple(t.placements), tuple(t.shape))
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        index = 0
        for group in obj.param_groups:
            for p in group["params"]:
                if _compat.is_dtensor(p):
                    out[f"{name}.state.{index}"] = Layout(
                        p.device_mesh, tuple(p.placements), tuple(p.shape)
                    )
                index += 1
    return out


def live_xla_layouts(state: Mapping[str, Any]) -> dict[str, xla.XlaLayout]:
    """``{fqn: XlaLayout}`` of every SPMD-sharded XLA tensor in the live state, and of the
    optimizer state to come, sharded like its parameter (``optim.state.3``)."""
    out: dict[str, xla.XlaLayout] = {}
    for fqn, t in flatten(state, allow_pickle=True).tensors.items():  # nothing is stored
        if (layout := xla.layout_of(t)) is not None:
            out[fqn] = layout
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = [p for group in obj.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            if (layout := xla.layout_of(p)) is not None:
                out.setdefault(f"{name}.state.{index}", layout)
    return out


def live_targets(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{fqn: tensor}`` of the live tensors that a restore can copy into as it reads: the
    parameters and buffers of modules, and the optimizer state that exists, when they are
    whole (unsharded XLA tensors, contiguous CPU tensors; not DTensors, not CUDA).

    Filled one by one as chunks are read (on the read threads, for CPU tensors), a restore
    needs no new memory for the state and leaves ``load_state_dict`` nothing to copy (DCP
    and torch_xla's own restore load in place as well). On XLA the host memory is a few
    chunks instead of the whole state; on CPU the restore skips touching a fresh page for
    every byte of state, which cost more than decoding it (``benchmarks/restore.py``).
    """
    out: dict[str, torch.Tensor] = {}
    for name, obj in state.items():
        entries: Iterable[tuple[str, Any]]
        if isinstance(obj, torch.nn.Module):
            entries = obj.state_dict(keep_vars=True).items()
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            entries = (
                (f"state.{index}.{key}", value)
                for index, p in enumerate(params)
                for key, value in obj.state.get(p, {}).items()
            )
        else:
            continue
        for key, t in entries:
            if isinstance(t, torch.Tensor) and _landable(t):
                out[f"{name}.{key}"] = t
    return out


def _landable(t: torch.Tensor) -> bool:
    """Whether a restore may write ``t`` in place as it reads (``live_targets``)."""
    if xla.is_xla(t):
        return not xla.is_sharded(t)
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor or another subclass
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_inference()
    )


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
