"""The state dicts of a step: one rank's view of it for a restore, or the whole job's.

``read_state_dicts`` builds each rank's state from a global manifest: for every tensor it
reads only the chunks whose boxes overlap what this rank holds (a DTensor's local shard,
the shards of an SPMD-sharded XLA tensor on this process's devices, or the whole tensor),
verifies each chunk's checksum over the whole chunk (it is the unit that
is checksummed, so sub-ranges are never read), and copies the overlap.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from checkflow import tree, xla
from checkflow.codec.base import dtype_from_name
from checkflow.parallel.sharding import LiveState, layout_box, to_dtensor
from checkflow.read.assemble import assemble, landing_spots
from checkflow.read.plan import BoxPlan, Part, ReadItem, plan_box
from checkflow.read.reader import CheckpointReader
from checkflow.state import iter_refs, unflatten


def read_box(
    reader: CheckpointReader,
    step: int,
    parts: list[Part],
    offset: tuple[int, ...] | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The box ``offset``/``shape`` of a global tensor (all of it by default), from the
    stored chunks ``parts`` that overlap it; the others are not read.

    Raises:
        CorruptCheckpointError: the stored chunks do not cover the box.
    """
    plan = plan_box(step, parts, offset, shape)
    return assemble(plan, (reader.chunk(step, item.rank, item.chunk) for item in plan.items))


Finish = Callable[[list[torch.Tensor]], Any]
"""Turns the boxes read for one tensor (in plan order) into the value restored."""


def _keep(got: list[torch.Tensor]) -> torch.Tensor:
    return got[0]


def _plan_tensor(
    step: int, fqn: str, parts: list[Part], live: LiveState
) -> tuple[list[BoxPlan], Finish, torch.Tensor | None]:
    """What a rank reads of one tensor, what it makes of it, and the live tensor it goes
    into: the whole tensor (read into its live CPU tensor, or copied into its live XLA
    tensor at once, when it has one); the box of its DTensor shard (a DTensor); or, for
    an SPMD-sharded XLA tensor, the box of each of this process's devices (an XLA tensor
    sharded alike, nothing else read)."""
    shape = tuple(parts[0][1].global_shape)
    target = live.target_for(fqn, shape, dtype_from_name(parts[0][1].dtype))
    if target is not None and xla.is_xla(target):
        return [plan_box(step, parts)], lambda got: xla.land(target, got[0]), target
    if target is not None:
        return [plan_box(step, parts)], _keep, target
    on_xla = live.xla_layout_for(fqn, shape)
    if on_xla is not None:
        boxes = on_xla.read_boxes()
        plans = [plan_box(step, parts, offset, box) for offset, box in boxes]
        return plans, lambda got: xla.place(on_xla, dict(zip(boxes, got, strict=True))), None
    layout = live.layout_for(fqn, shape)
    if layout is None:
        return [plan_box(step, parts)], _keep, None
    offset, box = layout_box(layout, shape)
    return (
        [plan_box(step, parts, offset, box)],
        lambda got: to_dtensor(got[0], layout, shape),
        None,
    )


def _read_plans(
    reader: CheckpointReader,
    step: int,
    plans: Mapping[str, list[BoxPlan]],
    finish: Mapping[str, Finish] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The boxes of ``plans``, read and assembled (each tensor's list of boxes handed to its
    ``finish`` as soon as it is read, so a tensor that goes to a device leaves the host
    before the next ones are read); a tensor in ``into`` (one box, the whole tensor) is
    read into that tensor, each chunk decoded in its place by the read threads; a chunk
    that several boxes overlap (the devices of one host on another mesh) is read and
    decoded once."""
    targets = into or {}
    items: list[ReadItem] = []
    spots: list[torch.Tensor | None] = []
    for fqn, boxes in plans.items():
        for plan in boxes:
            items.extend(plan.items)
            out = targets.get(fqn)
            spots.extend(landing_spots(plan, out) if out is not None else [None] * len(plan.items))
    decoded = _shared(items, spots, lambda unique, dest: reader.decode_parts(step, unique, dest))
    done = finish or {}
    result: dict[str, Any] = {}
    for fqn, boxes in plans.items():
        got = [assemble(plan, decoded, targets.get(fqn)) for plan in boxes]
        result[fqn] = done[fqn](got) if fqn in done else got
    return result


Decode = Callable[[list[ReadItem], list[torch.Tensor | None]], Iterator[torch.Tensor]]


def _shared(
    items: list[ReadItem], spots: list[torch.Tensor | None], decode: Decode
) -> Iterator[torch.Tensor]:
    """The decoded chunk of each of ``items`` in order, each distinct chunk decoded once
    (into its spot when it has one and no other item needs it).

    Every chunk goes into one stream, so that the reader decodes several at once on its
    threads (reads, checksums and decoders release the GIL). A chunk is kept only until
    the last item that needs it.
    """
    keys = [(it.rank, it.chunk.file, it.chunk.byte_offset) for it in items]
    uses = Counter(keys)
    first: dict[tuple[int, str, int], tuple[ReadItem, torch.Tensor | None]] = {}
    for key, item, spot in zip(keys, items, spots, strict=True):
        first.setdefault(key, (item, spot if uses[key] == 1 else None))
    stream = decode([item for item, _ in first.values()], [spot for _, spot in first.values()])
    held: dict[tuple[int, str, int], torch.Tensor] = {}
    for key in keys:
        if key not in held:
            held[key] = next(stream)
        out = held[key]
        uses[key] -= 1
        if not uses[key]:
            del held[key]
        yield out


def read_state_dicts(
    reader: CheckpointReader,
    step: int,
    rank: int,
    live: LiveState | None = None,
) -> dict[str, Any]:
    """``{name: state_dict}`` for ``rank`` of the job restoring now.

    Per-rank values (RNG, data position, schedulers) come from the same rank of the saved
    job when it had one, else from rank 0. Tensors come from every saved rank's chunks:
    whole tensors, the local shard of a DTensor laid out as in ``live`` (a DTensor is
    returned), or the shards of this process's devices of an SPMD-sharded XLA tensor (an
    XLA tensor is returned). ``live.module_keys`` lets a pipeline stage take its modules
    from whichever saved stage held them, under their global names.
    """
    live = live if live is not None else LiveState()
    world = reader.manifest(step).world_size
    skeleton = reader.skeleton(step, rank if rank < world else 0)
    for name, keys in live.module_keys.items():
        held = skeleton.get(name)
        if isinstance(held, Mapping) and keys != held.keys():
            skeleton[name] = _gather_module(reader, step, world, name, keys)
    index = reader.chunk_index(step)
    plans: dict[str, list[BoxPlan]] = {}
    finish: dict[str, Finish] = {}
    into: dict[str, torch.Tensor] = {}
    for fqn in iter_refs(skeleton):
        if fqn not in index:
            raise KeyError(f"step {step} has no tensor {fqn!r}")
        plans[fqn], finish[fqn], target = _plan_tensor(step, fqn, index[fqn], live)
        if target is None:
            continue
        live.landed.add(step)  # from here on, a failed read may leave live tensors mixed
        if not xla.is_xla(target):  # XLA ones are copied into by ``finish``
            into[fqn] = target
    return unflatten(skeleton, _read_plans(reader, step, plans, finish, into))


def read_xla_boxes(
    reader: CheckpointReader, step: int, live: LiveState, devices: set[int]
) -> dict[str, dict[xla.Box, torch.Tensor]]:
    """The boxes of the SPMD-sharded XLA tensors in ``live`` that ``devices`` hold, on the
    host: what one host of a multi-host job reads. A test that splits one process's
    virtual mesh into stand-in hosts calls this per host (``read_state_dicts`` reads for
    every device of the process: torch_xla places shards on all local devices at once).
    """
    index = reader.chunk_index(step)
    boxes: dict[str, list[xla.Box]] = {}
    plans: dict[str, list[BoxPlan]] = {}
    for fqn, parts in index.items():
        on_xla = live.xla_layout_for(fqn, parts[0][1].global_shape)
        mine = on_xla.read_boxes(devices) if on_xla is not None else []
        if mine:
            boxes[fqn] = mine
            plans[fqn] = [plan_box(step, parts, offset, box) for offset, box in mine]
    got = _read_plans(reader, step, plans)
    return {fqn: dict(zip(boxes[fqn], got[fqn], strict=True)) for fqn in plans}


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
        metadata.update(tree.metadata_of(held))
    if missing := keys - out.keys():
        raise KeyError(f"step {step} has no {name}.{sorted(missing)[0]} on any rank")
    return tree.with_metadata(out, metadata)


def consolidated_state_dicts(reader: CheckpointReader, step: int) -> dict[str, Any]:
    """``{name: state_dict}`` of the whole job with full tensors: rank 0's objects, each
    completed with the entries only other ranks saved (pipeline stages)."""
    skeleton = consolidated_skeleton(reader, step)
    return unflatten(skeleton, reader.tensors(step, set(iter_refs(skeleton))))


def consolidated_skeleton(reader: CheckpointReader, step: int, *, opaque: bool = False) -> Any:
    """The whole job's skeleton (``TensorRef`` leaves): rank 0's, each state completed with
    the entries only other ranks saved (the modules of later pipeline stages). Every export
    and ``load()`` read this, so none of them holds rank 0's stage only.

    Args:
        opaque: show pickled objects as ``objects.OpaqueObject`` (``CheckpointReader.skeleton``).
    """
    world = reader.manifest(step).world_size
    skeleton = reader.skeleton(step, 0, opaque=opaque)
    for r in range(1, world):
        for name, value in reader.skeleton(step, r, opaque=opaque).items():
            mine = skeleton.get(name)
            if isinstance(mine, Mapping) and isinstance(value, Mapping):
                extra = {k: v for k, v in value.items() if k not in mine}
                if extra:
                    mine.update(extra)  # type: ignore[attr-defined]
            elif name not in skeleton:
                skeleton[name] = value
    return skeleton
