"""``delta``: exact incremental encoding; only the blocks whose bits changed are stored.

Stored form of a delta (``params["sections"]`` gives the byte length of each part)::

    changed-block bitmap (zstd)   |   XOR(new bits, old bits) of the changed blocks,
                                      byte-shuffled, zstd

XOR leaves the sign, the exponent and the top of the mantissa at zero when an update is
small next to the value, so the shuffled high-byte planes compress to almost nothing.
Restore is bitwise: NaN payloads, infinities and -0.0 come back as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import zstandard

from checkflow.codec.base import Buffer, Codec, CodecError, Encoded, tensor_bytes, tensor_from_bytes
from checkflow.codec.blocks import (
    block_layout,
    changed_blocks,
    int_view,
    itemsize_of,
    pack_bitmap,
    region_indices,
    split_sections,
    unpack_bitmap,
)
from checkflow.codec.zstd import shuffle_bytes, unshuffle_bytes

DEFAULT_BLOCK = 1024
"""Elements per block of a flat chunk or a long row; short rows are one block each."""


@dataclass(slots=True)
class DeltaRef:
    """The previous snapshot of one chunk (its exact bits); one copy of the chunk."""

    prev: torch.Tensor
    """Flat copy of the last encoded chunk, updated in place."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def _refresh_full(x: torch.Tensor, ref: DeltaRef | None) -> DeltaRef:
    """``ref`` holding a copy of ``x``, reusing its buffer when the shape still fits."""
    flat = x.reshape(-1)
    if ref is not None and ref.dtype == x.dtype and ref.prev.numel() == flat.numel():
        ref.prev.copy_(flat)
        ref.shape = tuple(x.shape)
        return ref
    return DeltaRef(flat.clone(), tuple(x.shape), x.dtype)


class DeltaCodec(Codec):
    """Exact delta: XOR of the changed blocks against the previous checkpoint.

    Args:
        block: largest block, in elements (rows shorter than this are one block each).
        level: zstd level of the XOR payload.
    """

    name = "delta"
    incremental = True

    def __init__(self, block: int = DEFAULT_BLOCK, level: int = 1) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self.level = level

    def encode(self, x: torch.Tensor, ref: Any | None = None) -> tuple[Encoded, DeltaRef]:
        if not x.is_contiguous():
            raise ValueError("codec input must be contiguous")
        usable = (
            isinstance(ref, DeltaRef)
            and ref.shape == tuple(x.shape)
            and ref.dtype == x.dtype
            and x.numel() > 0
        )
        if not usable:
            return Encoded([tensor_bytes(x)], {"full": True}), _refresh_full(x, ref)
        assert isinstance(ref, DeltaRef)
        flat = x.reshape(-1)
        layout = block_layout(tuple(x.shape), self.block)
        changed = changed_blocks(flat, ref.prev, layout)
        bitmap = pack_bitmap(changed.numpy())
        xi, pi = int_view(flat), int_view(ref.prev)
        parts = []
        for region, rows, cols in region_indices(changed, layout):
            new = region.view(xi)[rows, cols]
            pv = region.view(pi)
            parts.append(torch.bitwise_xor(new, pv[rows, cols]).reshape(-1))
            pv[rows, cols] = new
        payload = b""
        if parts:
            xor = torch.cat(parts).view(x.dtype)
            payload = zstandard.ZstdCompressor(level=self.level).compress(shuffle_bytes(xor))
        if len(bitmap) + len(payload) >= x.numel() * x.element_size():
            # Cheaper to store the chunk as it is; ref already holds x.
            return Encoded([tensor_bytes(x)], {"full": True}), ref
        params = {
            "block": self.block,
            "changed": int(changed.sum()),
            "sections": [len(bitmap), len(payload)],
        }
        return Encoded([bitmap, payload], params, delta=True), ref

    def decode(
        self,
        data: Buffer,
        params: dict[str, Any],
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if params.get("full"):
            return tensor_from_bytes(data, dtype, shape)
        if base is None:
            raise CodecError("delta chunk needs the previous checkpoint (base) to decode")
        if tuple(base.shape) != tuple(shape) or base.dtype != dtype:
            raise CodecError(f"base is {tuple(base.shape)} {base.dtype}, chunk is {shape} {dtype}")
        layout = block_layout(tuple(shape), int(params["block"]))
        bitmap, payload = split_sections(data, [int(s) for s in params["sections"]])
        changed = torch.from_numpy(unpack_bitmap(bitmap, layout.nblocks))
        out = base.reshape(-1).clone()
        where = region_indices(changed, layout)
        if not where:
            return out.reshape(shape)
        itemsize = itemsize_of(dtype)
        expected = sum(len(rows) * r.blen for r, rows, _ in where) * itemsize
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise CodecError(f"delta payload is corrupt: {e}") from e
        if len(raw) != expected:
            raise CodecError(f"delta payload has {len(raw)} bytes, expected {expected}")
        xor = int_view(unshuffle_bytes(bytearray(raw), itemsize).view(dtype))
        oi, pos = int_view(out), 0
        for region, rows, cols in where:
            n = len(rows) * region.blen
            ov = region.view(oi)
            ov[rows, cols] = torch.bitwise_xor(
                ov[rows, cols], xor[pos : pos + n].view(-1, region.blen)
            )
            pos += n
        return out.reshape(shape)
