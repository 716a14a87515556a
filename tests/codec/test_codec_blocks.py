"""Block layout: blocks tile the chunk exactly and never cross a row (unless rows are tiny)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkflow.codec.blocks import block_layout, changed_blocks


def _cover(shape, block, min_row):
    layout = block_layout(shape, block, min_row)
    seen = torch.zeros(max(1, math.prod(shape)), dtype=torch.int32)
    for r in layout.regions:
        v = r.view(seen)
        v += 1
    return layout, seen[: math.prod(shape)]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    block=st.sampled_from([1, 3, 16, 64, 256]),
    min_row=st.sampled_from([0, 16]),
)
def test_blocks_cover_every_element_once_and_stay_inside_a_row(shape, block, min_row):
    layout, seen = _cover(shape, block, min_row)
    assert bool((seen == 1).all())
    assert layout.nblocks == sum(r.count for r in layout.regions)
    n = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)
    for r in layout.regions:
        assert r.blen <= max(block, n)
        if n >= min_row and len(shape) >= 2:
            # A block starts and ends inside one row.
            assert (r.offset % n) + (r.nblocks - 1) * r.blen + r.blen <= n


def test_an_embedding_row_is_one_block_so_a_changed_row_changes_one_block():
    x = torch.randn(100, 64)
    y = x.clone()
    y[17, 5] += 1
    layout = block_layout((100, 64), 256, 16)
    changed = changed_blocks(y.reshape(-1), x.reshape(-1), layout)
    assert layout.nblocks == 100 and changed.nonzero().reshape(-1).tolist() == [17]


def test_long_rows_split_into_near_equal_blocks_with_a_tail():
    layout = block_layout((3, 1009), 256, 16)
    assert [(r.nblocks, r.blen) for r in layout.regions] == [(3, 253), (1, 250)]


def test_changed_blocks_compare_bits_so_nan_equals_itself_and_signed_zero_differs():
    x = torch.tensor([float("nan"), 0.0, 1.0, 2.0])
    y = torch.tensor([float("nan"), -0.0, 1.0, 2.0])
    layout = block_layout((4,), 1)
    assert changed_blocks(y, x, layout).tolist() == [False, True, False, False]
