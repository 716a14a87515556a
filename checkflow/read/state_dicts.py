"""The state dicts of a step: one rank's view of it for a restore, or the whole job's.

``read_state_dicts`` builds each rank's state from a global manifest: for every tensor it
reads only the chunks whose boxes overlap what this rank holds (a DTensor's local shard, or
the whole tensor), verifies each chunk's checksum over the whole chunk (it is the unit that
is checksummed, so sub-ranges are never read), and copies the overlap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from checkflow import tree
from checkflow.parallel.sharding import Layout, LiveState, layout_box, to_dtensor
from checkflow.read.assemble import assemble
from checkflow.read.plan import BoxPlan, Part, plan_box
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


def _plan_tensor(step: int, parts: list[Part], layout: Layout | None) -> BoxPlan:
    """What a rank reads of one tensor: all of it, or the box of its DTensor shard."""
    if layout is None:
        return plan_box(step, parts)
    offset, shape = layout_box(layout, tuple(parts[0][1].global_shape))
    return plan_box(step, parts, offset, shape)


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
    live = live if live is not None else LiveState()
    world = reader.manifest(step).world_size
    skeleton = reader.skeleton(step, rank if rank < world else 0)
    for name, keys in live.module_keys.items():
        held = skeleton.get(name)
        if isinstance(held, Mapping) and keys != held.keys():
            skeleton[name] = _gather_module(reader, step, world, name, keys)
    index = reader.chunk_index(step)
    plans: dict[str, tuple[BoxPlan, Layout | None]] = {}
    for fqn in iter_refs(skeleton):
        if fqn not in index:
            raise KeyError(f"step {step} has no tensor {fqn!r}")
        parts = index[fqn]
        layout = live.layout_for(fqn, parts[0][1].global_shape)
        plans[fqn] = (_plan_tensor(step, parts, layout), layout)
    # Every chunk of every tensor in one stream, so that the reader decodes several at once
    # on its threads (reads, checksums and decoders release the GIL).
    decoded = reader.decode_parts(step, [it for plan, _ in plans.values() for it in plan.items])
    tensors: dict[str, Any] = {}
    for fqn, (plan, layout) in plans.items():
        box = assemble(plan, decoded)
        tensors[fqn] = (
            box if layout is None else to_dtensor(box, layout, tuple(plan.first[1].global_shape))
        )
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
        metadata.update(tree.metadata_of(held))
    if missing := keys - out.keys():
        raise KeyError(f"step {step} has no {name}.{sorted(missing)[0]} on any rank")
    return tree.with_metadata(out, metadata)


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
