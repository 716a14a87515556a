"""Block layout shared by the incremental codecs, and the small byte helpers they store.

A chunk is seen as ``rows x n`` (dim 0 by the rest for 2-D+, one row for 0-D/1-D). Blocks
never span two rows, so a changed embedding row never drags its neighbours into a delta:
each row is split into ``ceil(n / block)`` blocks of nearly equal length. The blocks form
at most two regular *regions* (the row's equal-length blocks, then a shorter tail block per
row), numbered region by region, row-major inside a region. Only the quantized codecs may
group very short rows (``min_row``) into one block, because their per-block scale would
otherwise cost more than the codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import zstandard

from checkflow.codec import frames
from checkflow.codec.base import Buffer, CodecError

INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}
"""Integer dtype with the same width, to compare and XOR raw bits (NaN == NaN, -0 != 0)."""


@dataclass(frozen=True, slots=True)
class Region:
    """A regular grid of blocks: ``nrows`` rows of ``nblocks`` blocks of ``blen`` elements."""

    offset: int
    """Element offset of the first block in the flat chunk."""
    nrows: int
    row_stride: int
    """Elements between the first blocks of two consecutive rows."""
    nblocks: int
    blen: int
    first: int
    """Global index of this region's first block."""

    @property
    def count(self) -> int:
        return self.nrows * self.nblocks

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """``(nrows, nblocks, blen)`` view of a flat chunk (no copy)."""
        return flat.as_strided(
            (self.nrows, self.nblocks, self.blen), (self.row_stride, self.blen, 1), self.offset
        )


@dataclass(frozen=True, slots=True)
class Layout:
    regions: tuple[Region, ...]
    nblocks: int
    numel: int


def rows_and_width(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


@lru_cache(maxsize=256)
def block_layout(shape: tuple[int, ...], block: int, min_row: int = 0) -> Layout:
    """The blocks of a chunk of ``shape``.

    Args:
        shape: the chunk's shape.
        block: the largest block, in elements.
        min_row: rows shorter than this are grouped, whole, ``block // n`` to a block.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    rows, n = rows_and_width(tuple(shape))
    numel = rows * n
    if numel == 0:
        return Layout((), 0, 0)
    regions: list[Region] = []
    if n < min_row and rows > 1 and block // n >= 2:
        per = block // n
        full, rest = divmod(rows, per)
        if full:
            regions.append(Region(0, full, per * n, 1, per * n, 0))
        if rest:
            regions.append(Region(full * per * n, 1, rest * n, 1, rest * n, full))
    else:
        k = -(-n // block)
        blen = -(-n // k)
        m, tail = divmod(n, blen)
        regions.append(Region(0, rows, n, m, blen, 0))
        if tail:
            regions.append(Region(m * blen, rows, n, 1, tail, rows * m))
    total = sum(r.count for r in regions)
    return Layout(tuple(regions), total, numel)


def int_view(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bits as a signed integer tensor of the same width (no copy)."""
    return x.view(INT_VIEW[x.element_size()])


def pack_bitmap(mask: np.ndarray) -> bytes:
    """Changed-block flags, one bit each, zstd-compressed (sparse maps shrink to ~nothing)."""
    return zstandard.ZstdCompressor(level=3).compress(np.packbits(mask).tobytes())


def unpack_bitmap(data: bytes | memoryview, nblocks: int) -> np.ndarray:
    """The changed-block flags :func:`pack_bitmap` stored, decoded within their size."""
    raw = frames.decompress(data, (nblocks + 7) // 8, "the changed-block map")
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=nblocks).astype(bool)


def compress_section(data: bytes | memoryview) -> bytes:
    """A small section (one kind byte per changed block), zstd-compressed; empty stays empty."""
    return zstandard.ZstdCompressor(level=3).compress(data) if len(data) else b""


def decompress_section(data: memoryview, size: int, what: str) -> np.ndarray:
    """The ``size`` bytes of a zstd section (:func:`compress_section`, a delta's payload) as
    writable uint8, decoded within ``size`` (:mod:`.frames`).

    Raises:
        CodecError: naming ``what``: the section claims or decodes to another size.
    """
    if size == 0:
        if data.nbytes:
            raise CodecError(f"{what}: {data.nbytes} stored bytes for an empty section")
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(frames.decompress(data, size, what), dtype=np.uint8)


def split_sections(data: Buffer, sizes: list[int]) -> list[memoryview]:
    """Cut the stored bytes into the sections whose lengths the params recorded."""
    mv = memoryview(data).cast("B")
    if sum(sizes) != mv.nbytes:
        raise CodecError(f"stored data has {mv.nbytes} bytes, sections say {sum(sizes)}")
    out, pos = [], 0
    for s in sizes:
        out.append(mv[pos : pos + s])
        pos += s
    return out


def changed_blocks(x: torch.Tensor, prev: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Bool per block: do its bits differ between ``x`` and ``prev`` (flat chunks)?"""
    xi, pi = int_view(x), int_view(prev)
    out = torch.empty(layout.nblocks, dtype=torch.bool)
    for r in layout.regions:
        xv, pv = r.view(xi), r.view(pi)
        dst = out[r.first : r.first + r.count].view(r.nrows, r.nblocks)
        # Row slabs of ~1M elements keep the temporary bool mask in cache.
        step = max(1, (1 << 20) // max(1, r.nblocks * r.blen))
        for i in range(0, r.nrows, step):
            # XOR then min/max: integer reductions along a row run ~10x faster than any(ne).
            xor = torch.bitwise_xor(xv[i : i + step], pv[i : i + step])
            dst[i : i + step] = (xor.amax(dim=-1) != 0) | (xor.amin(dim=-1) != 0)
    return out


def region_indices(
    changed: torch.Tensor, layout: Layout
) -> list[tuple[Region, torch.Tensor, torch.Tensor]]:
    """Per region, the (row, block) indices of its changed blocks, in global block order."""
    out = []
    for r in layout.regions:
        flat = torch.nonzero(changed[r.first : r.first + r.count]).reshape(-1)
        if flat.numel():
            out.append((r, flat // r.nblocks, flat % r.nblocks))
    return out


def itemsize_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shuffle_planes(raw: torch.Tensor, itemsize: int, inverse: bool = False) -> torch.Tensor:
    """Byte-shuffle a flat uint8 tensor of ``itemsize``-byte elements (byte k of every element
    together), or undo it. The torch-ops twin of the kernel's ``shuffle``."""
    if itemsize == 1 or raw.numel() == 0:
        return raw
    arr = raw.numpy()
    planes = arr.reshape(itemsize, -1).T if inverse else arr.reshape(-1, itemsize).T
    return torch.from_numpy(np.ascontiguousarray(planes).reshape(-1))
