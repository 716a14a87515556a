"""Everything checkflow does with torch_xla tensors, in one module.

torch_xla is optional: nothing here imports it until a tensor on an ``xla`` device (or a
process that already imported torch_xla, for the RNG) shows it is in use, so checkflow
runs without it. torch_xla's tensors are lazy: what a training step computes is a pending
graph until ``torch_xla.sync()`` runs it, and a device buffer that an in-place update
replaces is donated to the next graph (read after that, it is gone; holding the tensor
does not help, its ``detach()`` shows the update too). So a snapshot

- freezes the state with one graph cut (``freeze``): the cut also runs a device copy of
  every tensor, new buffers that no step updates or donates, so they can be moved to the
  host while training goes on, and the optimizer step never waits for the transfer (the
  price is one more device copy of the state until its transfer ends);
- moves the copies to the host in bulk: one ``_xla_get_cpu_tensors`` call for all whole
  tensors, one ``_get_local_shards`` call for all SPMD-sharded ones (these are what
  torch_xla's own checkpointing uses; there is no public bulk transfer in torch_xla 2.9).

An SPMD-sharded tensor (``mark_sharding`` over a mesh) is moved as the shards addressable
to this process, each at its global offset; a shard replicated over a mesh axis is taken
from its replica 0 only, so the union over hosts holds every element once.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

XLA_MODEL = "torch_xla.core.xla_model"


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def _xlac() -> Any:
    import torch_xla  # only where a tensor lives on an XLA device

    return torch_xla._XLAC


def identity(t: torch.Tensor) -> int:
    """A stable id of the XLA tensor behind ``t`` (a parameter, its ``detach()`` and its
    state_dict entry share it; an in-place update keeps it). XLA tensors have no storage
    pointer, so this stands in for one where the snapshot protects optimizer tensors."""
    return -int(_xlac()._xla_get_tensor_id(t))  # negative: never a real storage pointer


def cut() -> None:
    """Run the pending graph, so every tensor is device data (once per snapshot).

    Every ``sync()`` also advances the device's RNG seed, even with nothing pending; the
    seed is put back, so a run that checkpoints draws the same random numbers as one that
    does not (and as one resumed from the checkpoint, which saved the seed before the cut).
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    seed = xm.get_rng_state()
    torch_xla.sync()
    xm.set_rng_state(seed)


def freeze(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device copies of ``tensors`` as they are now, made by one graph cut.

    The cut runs whatever is pending with the copies in the same graph (once, however
    many tensors). A copy keeps its source's SPMD sharding, so it moves as the same shards.
    """
    if not tensors:
        return []
    xlac = _xlac()
    copies = []
    for t in tensors:
        copy = t.detach().clone()
        if is_sharded(t):
            xlac._xla_mark_sharding(copy, xlac._get_xla_op_sharding(t))
        copies.append(copy)
    cut()
    return copies


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole tensors on the host, in one bulk transfer (sharded ones are gathered)."""
    if not tensors:
        return []
    return list(_xlac()._xla_get_cpu_tensors(tensors))


def is_sharded(t: torch.Tensor) -> bool:
    """True for an SPMD tensor split over devices (tiled or partially replicated)."""
    kind = _xlac()._get_xla_sharding_type(t)
    return kind is not None and int(kind) != 0  # 0: replicated on every device


@dataclass(frozen=True, slots=True)
class HostShard:
    """One device's shard of a global tensor, on the host."""

    data: torch.Tensor
    offset: tuple[int, ...]
    device: int
    """The ordinal of the device that held it (``CPU:3`` -> 3)."""


def local_shards(
    tensors: list[torch.Tensor], devices: set[int] | None = None
) -> list[list[HostShard]]:
    """For each sharded tensor, its replica-0 shards held by ``devices`` (default: every
    device of this process), on the host, in one bulk transfer.

    torch_xla pads uneven shards; each shard is cut to its index range here. Unlike the
    bulk transfer, torch_xla's shard read fails on a tensor whose graph is still running
    (``freeze`` returns before its copies are computed), so it waits for the devices first.
    """
    if not tensors:
        return []
    xlac = _xlac()
    xlac._xla_wait_device_ops(devices=[])
    shards = xlac._get_local_shards(tensors)
    placement = xlac._get_local_shard_replica_and_indices(tensors)
    out: list[list[HostShard]] = []
    for t, per_device, where in zip(tensors, shards, placement, strict=True):
        mine: list[HostShard] = []
        for (data, device), (replica, index) in zip(per_device, where, strict=True):
            ordinal = _ordinal(device)
            if replica != 0 or (devices is not None and ordinal not in devices):
                continue
            offset, sizes = _box_of(index, tuple(t.shape))
            mine.append(HostShard(_unpad(data, sizes), offset, ordinal))
        out.append(mine)
    return out


def _box_of(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of the box that a list of slices (or ``...``: all) selects."""
    if index is Ellipsis or not shape:
        return (0,) * len(shape), shape
    starts, sizes = [], []
    for s, n in zip(index, shape, strict=True):
        start, stop, _ = s.indices(n)
        starts.append(start)
        sizes.append(max(stop - start, 0))
    return tuple(starts), tuple(sizes)


def _unpad(data: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    if tuple(data.shape) == sizes:
        return data
    for dim, n in enumerate(sizes):
        data = data.narrow(dim, 0, n)
    return data


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offset, shape) of a region of a global tensor."""


@dataclass(frozen=True, slots=True)
class XlaLayout:
    """How this process holds an SPMD-sharded tensor, for a restore: its sharding, and the
    box of the global tensor that each addressable device holds (in torch_xla's order of
    the local devices, which is the order ``place`` must give the shards in)."""

    sharding: Any
    """torch_xla's ``OpSharding`` of the live tensor."""
    global_shape: tuple[int, ...]
    devices: tuple[int, ...]
    """The ordinal of each addressable device (``CPU:3`` -> 3)."""
    boxes: tuple[Box, ...]
    """The box each device of ``devices`` holds."""

    def read_boxes(self, devices: set[int] | None = None) -> list[Box]:
        """The boxes to read for ``devices`` (default: every addressable one), each once:
        a box that several devices hold (a mesh axis that replicates) is read once."""
        out: dict[Box, None] = {}
        for device, box in zip(self.devices, self.boxes, strict=True):
            if devices is None or device in devices:
                out.setdefault(box, None)
        return list(out)


def layout_of(t: torch.Tensor) -> XlaLayout | None:
    """The layout of ``t`` when it is an SPMD-sharded XLA tensor, else None.

    Only the sharding is looked at: nothing is computed or moved, so it works on a tensor
    whose data is still a pending graph.
    """
    if not is_xla(t) or not is_sharded(t):
        return None
    xlac = _xlac()
    shape = tuple(t.shape)
    where = xlac._get_local_shard_replica_and_indices([t])[0]
    devices = tuple(_ordinal(d) for d in xlac._xla_get_runtime_devices())
    if len(devices) != len(where):
        raise RuntimeError(
            f"torch_xla placed {len(where)} shards on {len(devices)} local devices; "
            "checkflow cannot tell which device holds which shard"
        )
    boxes = tuple(_box_of(index, shape) for _replica, index in where)
    return XlaLayout(xlac._get_xla_op_sharding(t), shape, devices, boxes)


def place(layout: XlaLayout, boxes: Mapping[Box, torch.Tensor]) -> torch.Tensor:
    """A new XLA tensor sharded as ``layout``, each device given its box from ``boxes``
    (host tensors); one host-to-device transfer per device, nothing gathered.

    Raises:
        KeyError: ``boxes`` lacks the box of a local device (torch_xla needs all of them).
    """
    padded = tuple(max(sizes) for sizes in zip(*(s for _o, s in layout.boxes), strict=True))
    shards = [_pad(boxes[box], padded) for box in layout.boxes]
    shape = list(layout.global_shape)
    return _xlac()._global_tensor_from_cpu_shards(shards, layout.sharding, shape)


def _pad(data: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """torch_xla takes every shard at the padded shard shape (uneven splits pad the last)."""
    if tuple(data.shape) == shape:
        return data
    out = torch.zeros(shape, dtype=data.dtype)
    region = out
    for dim, n in enumerate(data.shape):
        region = region.narrow(dim, 0, n)
    region.copy_(data)
    return out


def land(live: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``live`` (an XLA tensor) holding ``host``'s values: one host-to-device transfer into
    the tensor training uses; returns ``live``.

    torch_xla keeps ``host`` alive until its transfer is done, so the caller may drop it.
    ``load_state_dict`` copying ``live`` into itself afterwards moves nothing.
    """
    with torch.no_grad():
        live.copy_(host)
    return live


def _ordinal(device: Any) -> int:
    return int(str(device).rsplit(":", 1)[-1])


@contextmanager
def shardings_kept(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Put the SPMD sharding of ``tensors`` back after the block (a ``load_state_dict``).

    torch_xla 2.9's in-place copy of a sharded XLA tensor into a sharded one leaves the
    destination replicated on every device (copying from a host tensor keeps it). A
    restore that places each host's shards on the devices copies exactly that way, so the
    sharding is marked again: a device-side reshard of the pending copy, not a transfer.
    """
    kept = [
        (t, _xlac()._get_xla_op_sharding(t), spec(t))
        for t in tensors
        if is_xla(t) and is_sharded(t)
    ]
    yield
    for t, sharding, before in kept:
        if spec(t) != before:
            _xlac()._xla_mark_sharding(t, sharding)


def spec(t: torch.Tensor) -> str:
    """torch_xla's text of the sharding of ``t`` (``{devices=[2,2]0,1,2,3}``)."""
    return str(_xlac()._get_xla_sharding_spec(t))


def rng_state() -> int | None:
    """The default XLA device's RNG seed when torch_xla is in use, else None.

    torch_xla exposes one integer seed per device (``xm.get_rng_state``); it is all there
    is to save: the generator state is derived from it and the graph's op counter."""
    xm = sys.modules.get(XLA_MODEL)
    if xm is None:
        return None
    return int(xm.get_rng_state())


def set_rng_state(seed: int) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(int(seed))
