"""``q8``, ``q4``, ``q2``: block-quantized deltas against the reconstructed previous checkpoint.

A full checkpoint (``ref=None``) stores the exact bytes, so a chain starts from the true
values. A delta stores, for each block whose bits changed since the previous *snapshot*,
the quantized difference to the previous *reconstruction* (what a restore gives), and moves
the reconstruction by exactly what a restore will decode. Error therefore never accumulates:
after any number of deltas every element is within half a quantization step of its latest
true value (LINEAR blocks: ``scale / 2`` plus the rounding to the tensor's dtype; LOG blocks:
``step / 2`` units in the last place, a relative bound). Unchanged blocks cost one bit.
Which blocks to send is decided against the snapshot, not the reconstruction: otherwise every
block changed once would keep a residual and be re-sent at every checkpoint.

Blocks whose values (and reconstruction) are all >= 0 are quantized in LOG space (on the
float's bit pattern, a piecewise-linear log2), detected per block: Adam's ``exp_avg_sq``
(positive, many decades) gets a relative error and never turns <= 0; a weight block with a
negative value stays LINEAR. ``log_space=False`` turns this off.

Non-finite values (NaN, +-inf, with their payload bits) are stored exactly: their block is
kept RAW, as is a block whose delta overflows fp32 or whose reconstruction would overflow the
dtype. A delta that would not be smaller than the chunk is written as a full exact chunk
(``delta=False``), which also restarts the chain. float32, bfloat16 and float16 run in the
compiled kernel (float16 where the compiler has ``_Float16``); without a C compiler the torch
ops give bit-identical results, slower; other dtypes (float64, ...) are stored exactly.

Stored form of a delta (``params["sections"]`` gives the byte length of each part)::

    changed-block bitmap (zstd) | kind per changed block (zstd) | (lo, scale|step) per
    quantized block, 2 x 4 bytes (fp32 or int32) | codes, packed per block | RAW blocks

``ref`` (opaque to callers) holds two copies of the chunk, both updated in place: the
previous snapshot and the reconstruction (2x the chunk's bytes per chunk and codec).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from checkflow.codec import _native
from checkflow.codec._quant_eager import (
    RAW,
    SUPPORTED,
    dequantize_blocks,
    pack_stream,
    quantize_blocks,
    stream_sizes,
    take,
    unpack_stream,
)
from checkflow.codec.base import (
    Buffer,
    Codec,
    CodecError,
    Encoded,
    delta_base,
    tensor_bytes,
    tensor_from_bytes,
)
from checkflow.codec.blocks import (
    Layout,
    Region,
    block_layout,
    changed_blocks,
    compress_section,
    decompress_section,
    int_view,
    itemsize_of,
    pack_bitmap,
    region_indices,
    split_sections,
    unpack_bitmap,
)

logger = logging.getLogger(__name__)

DEFAULT_BLOCK = 256
"""Elements per block: 8 bytes of (lo, scale) per 256 codes keeps q8 at ~0.258 of fp32."""
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_ROW = 16
"""Rows shorter than this are grouped whole into blocks (their scales would outweigh codes)."""
_BATCH = 1 << 18
"""Elements quantized per eager batch: large enough to amortize op overhead, cache-sized."""


@dataclass(slots=True)
class QuantRef:
    """What the next delta of a chunk needs: the last snapshot and the reconstruction."""

    snap: torch.Tensor
    """Flat copy of the last encoded chunk's true values (decides which blocks changed)."""
    recon: torch.Tensor
    """Flat reconstruction: bit-identical to what a restore of the last checkpoint gives."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def _full_ref(x: torch.Tensor, ref: Any | None) -> QuantRef:
    flat = x.reshape(-1)
    if isinstance(ref, QuantRef) and ref.dtype == x.dtype and ref.snap.numel() == flat.numel():
        ref.snap.copy_(flat)
        ref.recon.copy_(flat)
        ref.shape = tuple(x.shape)
        return ref
    return QuantRef(flat.clone(), flat.clone(), tuple(x.shape), x.dtype)


class QuantCodec(Codec):
    """Lossy incremental codec: ``bits``-bit block-quantized deltas.

    Args:
        block: largest block, in elements; a block never spans two rows (dim 0).
        log_space: quantize blocks that are all non-negative on their bit patterns
            (relative error); False keeps every block linear.
        max_log_error: a LOG block whose half step would exceed this relative error is
            stored exactly instead (the class default: 1 % for q8, none for q4/q2).
        native: use the compiled kernel: None = when it builds, False = never.
    """

    name = "q"
    lossless = False
    incremental = True
    bits = 8
    default_max_log_error: ClassVar[float | None] = None

    def __init__(
        self,
        *,
        block: int = DEFAULT_BLOCK,
        log_space: bool = True,
        max_log_error: float | None | Literal["default"] = "default",
        native: bool | None = None,
    ) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self.log_space = log_space
        self.max_log_error = (
            self.default_max_log_error if max_log_error == "default" else max_log_error
        )
        if self.max_log_error is not None and self.max_log_error < 0:
            raise ValueError(f"max_log_error must be >= 0, got {self.max_log_error}")
        self.native = native
        """Use the compiled kernel: None = when it builds, False = never (torch ops only)."""

    def _kernel(self, dtype: torch.dtype) -> _native.NativeKernel | None:
        if self.native is False:
            return None
        kernel = _native.load()
        if kernel is None or not kernel.supports(dtype):
            if self.native:
                raise RuntimeError(f"native quantization kernel unavailable for {dtype}")
            return None
        return kernel

    def encode(self, x: torch.Tensor, ref: Any | None = None) -> tuple[Encoded, QuantRef]:
        if not x.is_contiguous():
            raise ValueError("codec input must be contiguous")
        usable = (
            isinstance(ref, QuantRef)
            and ref.shape == tuple(x.shape)
            and ref.dtype == x.dtype
            and x.numel() > 0
            and x.dtype in SUPPORTED
        )
        if not usable:
            if x.dtype not in SUPPORTED and x.numel():
                logger.debug("%s stores %s chunks exactly (no quantization)", self.name, x.dtype)
            return Encoded([tensor_bytes(x)], {"full": True}), _full_ref(x, ref)
        assert isinstance(ref, QuantRef)
        layout = block_layout(tuple(x.shape), self.block, MIN_ROW)
        kernel = self._kernel(x.dtype)
        encode = kernel.encode if kernel is not None else _encode_eager
        sections, nchanged = encode(
            x.reshape(-1), ref, layout, self.bits, self.log_space, self._max_log_step(x.dtype)
        )
        if sum(len(s) for s in sections) >= x.numel() * x.element_size():
            # Nearly every block changed a lot, or the chunk is tiny: the exact bytes are
            # smaller, and restart the chain from the true values.
            return Encoded([tensor_bytes(x)], {"full": True}), _full_ref(x, ref)
        params = {
            "bits": self.bits,
            "block": self.block,
            "min_row": MIN_ROW,
            "changed": nchanged,
            "sections": [len(s) for s in sections],
        }
        return Encoded(list(sections), params, delta=True), ref

    def _max_log_step(self, dtype: torch.dtype) -> int:
        """Largest LOG step (units in the last place) within ``max_log_error``; -1: any."""
        if self.max_log_error is None:
            return -1
        # k units in the last place move a value by at most k * 2**-mantissa_bits of itself.
        return int(2 * self.max_log_error * 2 ** MANTISSA_BITS[dtype])

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
        base = delta_base(self.name, base, dtype, shape)
        bits = int(params["bits"])
        if bits not in (2, 4, 8):
            raise CodecError(f"unsupported code width {bits}")
        layout = block_layout(tuple(shape), int(params["block"]), int(params["min_row"]))
        sections = split_sections(data, [int(s) for s in params["sections"]])
        changed = unpack_bitmap(sections[0], layout.nblocks)
        kinds = decompress_section(sections[1], int(changed.sum()), "block kinds")
        kernel = self._kernel(dtype)
        src = base.reshape(-1).contiguous()
        if kernel is not None:
            # One pass: unchanged blocks are copied, changed ones decoded, from base to out.
            out = _native.fresh(src.numel(), src.dtype)
            kernel.decode(src, out, layout, bits, changed, kinds, sections[2:])
        else:
            out = src.clone()
            _decode_eager(out, layout, bits, changed, kinds, sections[2:])
        return out.reshape(shape)


class Q8Codec(QuantCodec):
    """8-bit block-quantized deltas (~0.26 of fp32 when every block changes)."""

    name = "q8"
    bits = 8
    default_max_log_error = 0.01


class Q4Codec(QuantCodec):
    """4-bit block-quantized deltas (~0.13 of fp32 when every block changes)."""

    name = "q4"
    bits = 4


class Q2Codec(QuantCodec):
    """2-bit block-quantized deltas (~0.07 of fp32 when every block changes)."""

    name = "q2"
    bits = 2


def _encode_eager(
    flat: torch.Tensor, ref: QuantRef, layout: Layout, bits: int, log_space: bool, max_step: int
) -> tuple[list[bytes], int]:
    changed = changed_blocks(flat, ref.snap, layout)
    kinds_p, meta_p, codes_p, raw_p = [], [], [], []
    for region, rows, cols in region_indices(changed, layout):
        xv, rv, sv = (region.view(int_view(t)) for t in (flat, ref.recon, ref.snap))
        step = max(1, _BATCH // region.blen)
        for i in range(0, len(rows), step):
            ri, ci = rows[i : i + step], cols[i : i + step]
            run = _run(region, ri, ci)
            if run is not None:  # a run of whole blocks: views, no gather/scatter
                xb, rb, sb = (t[run].view(-1, region.blen) for t in (flat, ref.recon, ref.snap))
            else:
                xb, rb = xv[ri, ci].view(flat.dtype), rv[ri, ci].view(flat.dtype)
            kinds, meta, codes, new, codes16 = quantize_blocks(xb, rb, bits, log_space, max_step)
            quant = kinds != RAW
            every = bool(quant.all())
            kinds_p.append(kinds)
            meta_p.append(meta if every else meta[quant])
            if every:
                codes_p.append(pack_stream(kinds, codes, codes16, bits))
            else:
                c16 = codes16[quant] if codes16 is not None else None
                codes_p.append(pack_stream(kinds[quant], codes[quant], c16, bits))
            if not every:
                raw_p.append(take(xb, ~quant).reshape(-1))
            if run is not None:
                rb.copy_(new)
                sb.copy_(xb)
            else:
                rv[ri, ci] = int_view(new)
                sv[ri, ci] = int_view(xb)
    if not kinds_p:
        return [pack_bitmap(changed.numpy()), b"", b"", b"", b""], 0
    kinds = torch.cat(kinds_p)
    sections = [
        pack_bitmap(changed.numpy()),
        compress_section(tensor_bytes(kinds)),
        bytes(tensor_bytes(torch.cat(meta_p))),
        b"".join(bytes(tensor_bytes(c.contiguous())) for c in codes_p),
        b"".join(bytes(tensor_bytes(r.contiguous())) for r in raw_p),
    ]
    return sections, int(kinds.numel())


def _run(region: Region, rows: torch.Tensor, cols: torch.Tensor) -> slice | None:
    """The flat element slice of these blocks when they are consecutive in memory."""
    if region.row_stride != region.nblocks * region.blen or not len(rows):
        return None
    first = int(rows[0]) * region.nblocks + int(cols[0])
    last = int(rows[-1]) * region.nblocks + int(cols[-1])
    if last - first != len(rows) - 1:
        return None
    start = region.offset + first * region.blen
    return slice(start, start + len(rows) * region.blen)


def _decode_eager(
    out: torch.Tensor,
    layout: Layout,
    bits: int,
    changed: np.ndarray,
    kinds_np: np.ndarray,
    sections: list[memoryview],
) -> None:
    meta_b, codes_b, raw_b = sections
    kinds = torch.from_numpy(kinds_np.copy())
    quant = kinds != RAW
    nq = int(quant.sum())
    meta = _frombuf(meta_b, torch.int32, nq * 2, "scales").view(nq, 2)
    codes_all = _frombuf(codes_b, torch.uint8, len(codes_b), "codes")
    raw_all = _frombuf(raw_b, out.dtype, len(raw_b) // itemsize_of(out.dtype), "raw blocks")
    pos = qpos = cpos = rpos = 0
    for region, rows, cols in region_indices(torch.from_numpy(changed), layout):
        ov = region.view(int_view(out))
        step = max(1, _BATCH // region.blen)
        for i in range(0, len(rows), step):
            ri, ci = rows[i : i + step], cols[i : i + step]
            k = len(ri)
            kb = kinds[pos : pos + k]
            qmask = quant[pos : pos + k]
            kq = int(qmask.sum())
            nbytes = int(stream_sizes(kb[qmask], region.blen, bits).sum())
            packed = codes_all[cpos : cpos + nbytes]
            raw = raw_all[rpos : rpos + (k - kq) * region.blen]
            if packed.numel() != nbytes or raw.numel() != (k - kq) * region.blen:
                raise CodecError("quantized delta is shorter than its block map says")
            codes = unpack_stream(packed, kb[qmask], region.blen, bits)
            run = _run(region, ri, ci)
            ob = out[run].view(-1, region.blen) if run is not None else ov[ri, ci].view(out.dtype)
            new = dequantize_blocks(
                ob, kb, meta[qpos : qpos + kq], codes, raw.view(-1, region.blen)
            )
            if run is not None:
                ob.copy_(new)
            else:
                ov[ri, ci] = int_view(new)
            pos, qpos, cpos, rpos = pos + k, qpos + kq, cpos + nbytes, rpos + raw.numel()
    if cpos != codes_all.numel() or rpos != raw_all.numel() or qpos != nq:
        raise CodecError("quantized delta is longer than its block map says")


def _frombuf(data: memoryview, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    size = itemsize_of(dtype)
    if data.nbytes != count * size:
        raise CodecError(f"{what}: {data.nbytes} bytes, expected {count * size}")
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)
