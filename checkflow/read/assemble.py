"""The one executor of read plans: copy decoded chunks into a box and check coverage.

Both a consolidated read (whole tensors) and a resharded one (a DTensor's local shard) end
here, so what "the chunks do not cover the tensor" means is decided once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from checkflow.codec.base import dtype_from_name
from checkflow.read.errors import CorruptCheckpointError
from checkflow.read.plan import BoxPlan, ReadItem


def assemble(
    plan: BoxPlan, decoded: Iterator[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The box of ``plan``, filled from ``decoded``: the decoded chunk of each of
    ``plan.items``, in order (exactly one is taken per item). With ``out`` (a tensor of the
    box's shape, e.g. a live one) the box is filled there; a chunk decoded into its place
    in ``out`` already (``landing_spots``) is not copied again.

    Raises:
        CorruptCheckpointError: the stored chunks do not cover the box.
    """
    if plan.whole_chunk and out is None:
        return next(decoded)
    if out is None:
        out = torch.empty(plan.shape, dtype=dtype_from_name(plan.dtype))
    with torch.no_grad():
        for item in plan.items:
            src, dst = next(decoded), _place(item, out.detach())
            for dim, n in enumerate(item.lengths):
                src = src.narrow(dim, item.chunk_offset[dim], n)
            if not _same_memory(src, dst):
                dst.copy_(src)
    if plan.covered < plan.numel:
        rank, first = plan.first
        raise CorruptCheckpointError(
            plan.step,
            rank,
            plan.fqn,
            first.file,
            f"chunks cover {plan.covered} of {plan.numel} elements",
        )
    return out


def landing_spots(plan: BoxPlan, out: torch.Tensor) -> list[torch.Tensor | None]:
    """For each item of ``plan``, the part of ``out`` that its whole chunk can be decoded
    straight into (a contiguous view); None where the item is part of its chunk, or its
    place is not contiguous (``assemble`` copies those)."""
    spots: list[torch.Tensor | None] = []
    for item in plan.items:
        whole = not any(item.chunk_offset) and item.lengths == tuple(item.chunk.shape)
        dst = _place(item, out.detach())
        spots.append(dst if whole and dst.is_contiguous() else None)
    return spots


def _place(item: ReadItem, box: torch.Tensor) -> torch.Tensor:
    """The part of ``box`` that ``item`` fills."""
    for dim, n in enumerate(item.lengths):
        box = box.narrow(dim, item.box_offset[dim], n)
    return box


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
