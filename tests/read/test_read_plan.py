"""Read plans are pure data, and the one executor fills a box from them or names the gap."""

from __future__ import annotations

import pytest
import torch

from checkflow import manifest as mf
from checkflow.read.assemble import assemble
from checkflow.read.errors import CorruptCheckpointError
from checkflow.read.plan import plan_box


def _chunk(offset: list[int], shape: list[int], global_shape: list[int]) -> mf.ChunkEntry:
    return mf.ChunkEntry(
        fqn="model.w",
        dtype="float32",
        global_shape=global_shape,
        offset=offset,
        shape=shape,
        codec="raw",
        file=f"data-{offset[0]}.bin",
        byte_offset=0,
        nbytes=0,
        checksum="",
    )


def _rows(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo * 4, hi * 4, dtype=torch.float32).reshape(hi - lo, 4)


def test_box_plan_lists_only_overlapping_chunks_with_offsets_in_chunk_and_box() -> None:
    parts = [(0, _chunk([0, 0], [4, 4], [8, 4])), (1, _chunk([4, 0], [4, 4], [8, 4]))]

    plan = plan_box(7, parts, offset=(5, 1), shape=(2, 2))

    assert [(i.rank, i.chunk_offset, i.box_offset, i.lengths) for i in plan.items] == [
        (1, (1, 1), (0, 0), (2, 2))
    ]
    assert plan.covered == plan.numel == 4 and not plan.whole_chunk


def test_assemble_copies_each_overlap_into_the_box() -> None:
    parts = [(0, _chunk([0, 0], [4, 4], [8, 4])), (1, _chunk([4, 0], [4, 4], [8, 4]))]
    plan = plan_box(7, parts, offset=(3, 0), shape=(2, 4))

    out = assemble(plan, iter([_rows(0, 4), _rows(4, 8)]))

    assert torch.equal(out, _rows(3, 5))


def test_a_box_that_is_one_stored_chunk_is_returned_without_a_copy() -> None:
    parts = [(0, _chunk([0, 0], [4, 4], [8, 4])), (1, _chunk([4, 0], [4, 4], [8, 4]))]
    plan = plan_box(7, parts, offset=(4, 0), shape=(4, 4))
    chunk = _rows(4, 8)

    assert plan.whole_chunk
    assert assemble(plan, iter([chunk])) is chunk


def test_assemble_names_step_rank_tensor_and_gap_when_chunks_do_not_cover_the_tensor() -> None:
    plan = plan_box(7, [(2, _chunk([0, 0], [4, 4], [8, 4]))])

    with pytest.raises(CorruptCheckpointError, match=r"step 7, rank 2, .*cover 16 of 32"):
        assemble(plan, iter([_rows(0, 4)]))
