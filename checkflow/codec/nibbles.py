"""A byte plane of few distinct values as 4-bit codes, two per byte, with its rare other
values listed apart: how the ``zstd`` codec stores a float's exponent plane before zstd.

A trained fp32 tensor's top byte (sign and 7 exponent bits) takes 11-26 distinct values,
and its 15 most frequent cover 99.97-100 % of the elements. Coded this way, zstd's
entropy stage sees half the bytes, each a pair of exponents: measured on
``benchmarks/zstd_planes.py``'s tensors, 0.21-0.33 bytes per element against 0.28-0.37
for the plain plane, and decoding (codes expanded included) ~1.7x faster: zstd's Huffman
decoding was most of a zstd restore. The compiled kernel does the packing; numpy gives the
same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from checkflow.codec import _native
from checkflow.codec.base import CodecError

ESCAPE = 15
"""The code of a value outside the plane's 15 most frequent."""
MAX_ESCAPE_SHARE = 1 / 64
"""Above this share of escaped elements (5 bytes each) a plane is left to plain zstd."""


@dataclass(slots=True)
class Packed:
    values: list[int]
    """The byte that each code 0..14 stands for (fewer when the plane has fewer values)."""
    codes: np.ndarray
    """``ceil(n / 2)`` bytes: element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` high."""
    positions: np.ndarray
    """uint32: the elements whose value is not in ``values``, ascending."""
    escaped: np.ndarray
    """uint8: their values."""


def pack(plane: np.ndarray, sample: np.ndarray) -> Packed | None:
    """``plane`` (uint8) coded with the 15 most frequent values of ``sample`` (a part of
    it); None when more than ``MAX_ESCAPE_SHARE`` of it falls outside them."""
    counts = np.bincount(sample, minlength=256)
    top = [int(v) for v in np.argsort(counts, kind="stable")[::-1][:ESCAPE] if counts[v]]
    code = np.full(256, ESCAPE, dtype=np.uint8)
    code[top] = np.arange(len(top), dtype=np.uint8)
    limit = int(plane.size * MAX_ESCAPE_SHARE)
    kernel = _native.load()
    if kernel is not None:
        got = kernel.nib4_pack(plane, code, limit)
        if got is None:
            return None
        packed, positions, escaped = got
        return Packed(top, packed, positions, escaped)
    codes = code[plane]
    positions = np.flatnonzero(codes == ESCAPE).astype(np.uint32)
    if positions.size > limit:
        return None
    padded = np.zeros(plane.size + (plane.size & 1), dtype=np.uint8)
    padded[: plane.size] = codes
    packed = padded[0::2] | (padded[1::2] << 4)
    return Packed(top, packed, positions, plane[positions])


def unpack(values: list[Any], codes: Any, positions: Any, escaped: Any, out: np.ndarray) -> None:
    """Fill ``out`` (uint8, the plane's length) from the parts :func:`pack` made.

    Raises:
        CodecError: the parts do not describe a plane of ``out``'s length.
    """
    n = out.size
    if not (isinstance(values, list) and len(values) <= ESCAPE):
        raise CodecError(f"a 4-bit plane lists {values!r:.40} as its values")
    if not all(isinstance(v, int) and 0 <= v <= 255 for v in values):
        raise CodecError(f"a 4-bit plane lists {values!r:.40} as its values")
    table = np.zeros(16, dtype=np.uint8)
    table[: len(values)] = values
    src = np.frombuffer(codes, dtype=np.uint8)
    if src.size != (n + 1) // 2:
        raise CodecError(f"a 4-bit plane of {n} bytes holds {src.size} bytes of codes")
    where = np.frombuffer(positions, dtype="<u4")
    if where.size and int(where.max()) >= n:
        raise CodecError(f"a 4-bit plane of {n} bytes lists an escape at {int(where.max())}")
    kernel = _native.load()
    if kernel is not None:
        kernel.nib4_unpack(src, n, table, out)
    else:
        pairs = np.empty(src.size * 2, dtype=np.uint8)
        pairs[0::2] = table[src & 15]
        pairs[1::2] = table[src >> 4]
        out[:] = pairs[:n]
    out[where] = np.frombuffer(escaped, dtype=np.uint8)
