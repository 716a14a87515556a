"""Read plans: which part of which stored chunk fills which part of a box. Pure.

A box is a region of a global tensor (an offset and a shape): the whole tensor for a
consolidated read, or a DTensor's local shard for a resharded one. Its plan lists, for
every stored chunk that overlaps it, the overlap as offsets in the chunk and in the box,
like DCP's ``ReadItem``. A chunk is the unit that is checksummed, so a chunk in the plan is
read whole; one that does not overlap is not in the plan, and never read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from checkflow import manifest as mf

Part = tuple[int, mf.ChunkEntry]
"""A stored chunk of a tensor and the rank that saved it."""


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``lengths`` elements per dimension from ``chunk`` at ``chunk_offset`` into the
    box at ``box_offset``."""

    rank: int
    chunk: mf.ChunkEntry
    chunk_offset: tuple[int, ...]
    box_offset: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclass(frozen=True, slots=True)
class BoxPlan:
    """Everything needed to fill one box of tensor ``fqn``."""

    step: int
    fqn: str
    dtype: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    items: tuple[ReadItem, ...]
    first: Part
    """The first stored chunk of the tensor: where an error points when none covers the box."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def covered(self) -> int:
        """Elements of the box the plan fills (overlaps are disjoint in a valid checkpoint)."""
        return sum(item.numel for item in self.items)

    @property
    def whole_chunk(self) -> bool:
        """The box is exactly one stored chunk: its decoded tensor is the result, no copy."""
        if len(self.items) != 1:
            return False
        chunk = self.items[0].chunk
        return tuple(chunk.offset) == self.offset and tuple(chunk.shape) == self.shape


def overlap(
    chunk: mf.ChunkEntry, rank: int, offset: tuple[int, ...], shape: tuple[int, ...]
) -> ReadItem | None:
    """The part of ``chunk`` inside the box ``offset``/``shape``; None when they miss."""
    lo = [max(a, b) for a, b in zip(chunk.offset, offset, strict=True)]
    hi = [
        min(a + n, b + m)
        for a, n, b, m in zip(chunk.offset, chunk.shape, offset, shape, strict=True)
    ]
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return ReadItem(
        rank=rank,
        chunk=chunk,
        chunk_offset=tuple(a - c for a, c in zip(lo, chunk.offset, strict=True)),
        box_offset=tuple(a - o for a, o in zip(lo, offset, strict=True)),
        lengths=tuple(b - a for a, b in zip(lo, hi, strict=True)),
    )


def plan_box(
    step: int,
    parts: Iterable[Part],
    offset: tuple[int, ...] | None = None,
    shape: tuple[int, ...] | None = None,
) -> BoxPlan:
    """The plan that fills box ``offset``/``shape`` (the whole tensor by default) from
    ``parts``, every stored chunk of one tensor."""
    parts = list(parts)
    first = parts[0][1]
    if shape is None:
        shape = tuple(first.global_shape)
    if offset is None:
        offset = (0,) * len(shape)
    items = tuple(
        item for rank, c in parts if (item := overlap(c, rank, offset, shape)) is not None
    )
    return BoxPlan(step, first.fqn, first.dtype, offset, shape, items, parts[0])
