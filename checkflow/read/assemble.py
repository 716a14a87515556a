"""The one executor of read plans: copy decoded chunks into a box and check coverage.

Both a consolidated read (whole tensors) and a resharded one (a DTensor's local shard) end
here, so what "the chunks do not cover the tensor" means is decided once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from checkflow.codec.base import dtype_from_name
from checkflow.read.errors import CorruptCheckpointError
from checkflow.read.plan import BoxPlan


def assemble(plan: BoxPlan, decoded: Iterator[torch.Tensor]) -> torch.Tensor:
    """The box of ``plan``, filled from ``decoded``: the decoded chunk of each of
    ``plan.items``, in order (exactly one is taken per item).

    Raises:
        CorruptCheckpointError: the stored chunks do not cover the box.
    """
    if plan.whole_chunk:
        return next(decoded)
    out = torch.empty(plan.shape, dtype=dtype_from_name(plan.dtype))
    for item in plan.items:
        src, dst = next(decoded), out
        for dim, n in enumerate(item.lengths):
            src = src.narrow(dim, item.chunk_offset[dim], n)
            dst = dst.narrow(dim, item.box_offset[dim], n)
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
