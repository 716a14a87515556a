"""Block quantization in plain torch ops: the reference arithmetic and the portable path.

Each changed block is stored in one of three kinds:

* ``LINEAR``: ``d = float32(x) - float32(r)`` quantized with an asymmetric per-block
  ``(lo, scale)`` in fp32; ``r' = dtype(float32(r) + (lo + float32(q) * scale))``.
* ``LOG``: for blocks where ``x`` and ``r`` are all non-negative and finite, the same on the
  *integer bit patterns* (a float's bits are a piecewise-linear log2 of it), with an integer
  ``(lo, step)``: ``bits(r') = clamp(bits(r) + lo + q * step, 0, max finite)``. The error is
  relative (<= step/2 units in the last place), so values spanning many decades, such as
  Adam's ``exp_avg_sq``, keep their small entries and never turn <= 0.
* ``RAW``: the block's exact bits (non-finite values, or a delta that overflows fp32).

Every operation is one IEEE rounding (separate mul and add, no fused multiply-add) or exact
integer arithmetic, so the native kernel reproduces ``r'`` bit for bit; the encoder's
reconstruction and a restore agree exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from checkflow.codec.blocks import int_view

LINEAR, LOG, RAW, LOG16 = 1, 2, 3, 4
"""Kinds of a changed block, stored one byte each. LOG16: a LOG block with 16-bit codes,
used when 8 bits would exceed the codec's relative error bound (an entry leaving zero)."""
LEVELS16 = 65535

MAX_FINITE_BITS = {torch.float32: 0x7F7FFFFF, torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}
SUPPORTED = tuple(MAX_FINITE_BITS)


def dequant_linear(
    r: torch.Tensor, q: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``float32(r) + (lo + float32(q) * scale)`` rounded to ``r.dtype``; ``q`` is ``(k, n)``."""
    t = q.to(torch.float32) * scale[:, None]
    t = lo[:, None] + t
    return (r.to(torch.float32) + t).to(r.dtype)


def dequant_log(
    r: torch.Tensor, q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """``r`` moved by ``lo + q * step`` units in the last place, clamped to finite >= 0."""
    bits = int_view(r).to(torch.int64)
    bits += lo.to(torch.int64)[:, None] + q.to(torch.int64) * step.to(torch.int64)[:, None]
    bits.clamp_(0, MAX_FINITE_BITS[r.dtype])
    return bits.to(int_view(r).dtype).view(r.dtype)


def _all_finite(v: torch.Tensor) -> torch.Tensor:
    """Per row: no NaN/inf (exponent bits not all ones); integer reductions vectorize well."""
    vi = int_view(v)
    mag = vi & (0x7FFFFFFF if vi.dtype == torch.int32 else 0x7FFF)
    return mag.amax(dim=-1) <= MAX_FINITE_BITS[v.dtype]


def _quant_linear(
    x: torch.Tensor, r: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d = x.to(torch.float32) - r.to(torch.float32)
    # NaN propagates through amin/amax and inf makes the scale inf: non-finite x or r, or a
    # delta that overflows fp32, all land in ``not ok`` without a separate isfinite pass.
    lo, hi = d.amin(dim=-1), d.amax(dim=-1)
    scale = (hi - lo) / levels
    inv = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    ok = torch.isfinite(lo) & torch.isfinite(scale) & torch.isfinite(inv)
    lo, scale = torch.where(ok, lo, 0.0), torch.where(ok, scale, 0.0)
    inv = torch.where(ok, inv, 0.0)
    # Multiply by the reciprocal and round half up, as the kernel does (encoder-only choice).
    q = (d - lo[:, None]).mul_(inv[:, None]).add_(0.5).floor_().clamp_(0, levels)
    q = torch.nan_to_num_(q, nan=0.0).to(torch.uint8)
    new = dequant_linear(r, q, lo, scale)
    ok &= _all_finite(new)
    meta = torch.stack([lo.view(torch.int32), scale.view(torch.int32)], dim=1)
    return q, meta, new, ok


def _quant_log(
    x: torch.Tensor, r: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = int_view(x).to(torch.int64) - int_view(r).to(torch.int64)
    lo, hi = d.amin(dim=-1), d.amax(dim=-1)
    step = (hi - lo + (levels - 1)) // levels
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = (d - lo[:, None] + safe[:, None] // 2) // safe[:, None]
    q = q.to(torch.uint8 if levels < 256 else torch.int32)
    lo32, step32 = lo.to(torch.int32), step.to(torch.int32)
    new = dequant_log(r, q, lo32, step32)
    return q, torch.stack([lo32, step32], dim=1), new


def _log_eligible(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per row: x and r all finite and >= 0 (sign bit clear): bits in [0, max finite]."""
    top = MAX_FINITE_BITS[x.dtype]
    xi, ri = int_view(x), int_view(r)
    return (
        (xi.amin(dim=-1) >= 0)
        & (xi.amax(dim=-1) <= top)
        & (ri.amin(dim=-1) >= 0)
        & (ri.amax(dim=-1) <= top)
    )


def quantize_blocks(
    x: torch.Tensor, r: torch.Tensor, bits: int, log_space: bool, max_step: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``k`` changed blocks ``x`` (``(k, n)``) against their reconstruction ``r``.

    A LOG block whose step would exceed ``max_step`` units (when >= 0) gets 16-bit codes
    (LOG16), or is kept RAW when even those are too coarse.

    Returns:
        ``(kinds (k,) uint8, meta (k, 2) int32, codes (k, n) uint8, new r (k, n), codes16)``
        where ``codes16`` is ``(k, n)`` int32 for LOG16 rows, or None when there is none.
        meta and codes rows of other kinds are meaningless (they are not stored).
    """
    levels = (1 << bits) - 1
    k = x.shape[0]
    use_log = _log_eligible(x, r) if log_space else torch.zeros(k, dtype=torch.bool)
    if not bool(use_log.any()):
        # The common case (weights, exp_avg): every block linear or RAW, no scatter needed.
        codes, meta, new, ok = _quant_linear(x, r, levels)
        kinds = torch.where(ok, LINEAR, RAW).to(torch.uint8)
        if not bool(ok.all()):
            put(new, ~ok, take(x, ~ok))
        return kinds, meta, codes, new, None
    kinds = torch.full((k,), RAW, dtype=torch.uint8)
    meta = torch.zeros((k, 2), dtype=torch.int32)
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    new = x.clone()
    codes16 = None
    for mask, kind in ((~use_log, LINEAR), (use_log, LOG)):
        if not bool(mask.any()):
            continue
        every = bool(mask.all())
        xs, rs = (x, r) if every else (take(x, mask), take(r, mask))
        idx = mask.nonzero().reshape(-1)
        if kind == LINEAR:
            q, m, n, ok = _quant_linear(xs, rs, levels)
        else:
            q, m, n = _quant_log(xs, rs, levels)
            ok = m[:, 1] <= max_step if max_step >= 0 else torch.ones_like(idx, dtype=torch.bool)
            if not bool(ok.all()):
                codes16 = _wide_log(take(xs, ~ok), take(rs, ~ok), idx[~ok], max_step, x, kinds,
                                    meta, new)  # fmt: skip
        if not bool(ok.all()):
            idx, q, m, n = idx[ok], q[ok], m[ok], take(n, ok)
        kinds[idx] = kind
        meta[idx] = m
        codes[idx] = q
        put(new, idx, n)
    return kinds, meta, codes, new, codes16


def _wide_log(
    xs: torch.Tensor,
    rs: torch.Tensor,
    idx: torch.Tensor,
    max_step: int,
    x: torch.Tensor,
    kinds: torch.Tensor,
    meta: torch.Tensor,
    new: torch.Tensor,
) -> torch.Tensor | None:
    """Re-quantize LOG blocks ``idx`` with 16-bit codes; those still too coarse stay RAW."""
    q, m, n = _quant_log(xs, rs, LEVELS16)
    ok = m[:, 1] <= max_step
    if not bool(ok.any()):
        return None
    idx = idx[ok]
    codes16 = torch.zeros(x.shape, dtype=torch.int32)
    kinds[idx] = LOG16
    meta[idx] = m[ok]
    codes16[idx] = q[ok]
    put(new, idx, take(n, ok))
    return codes16


def dequantize_blocks(
    r: torch.Tensor,
    kinds: torch.Tensor,
    meta: torch.Tensor,
    codes: torch.Tensor,
    raw: torch.Tensor,
) -> torch.Tensor:
    """The new reconstruction of ``k`` blocks from their stored form.

    Args:
        r: ``(k, n)`` previous reconstruction of the blocks.
        kinds: ``(k,)`` kind of each block.
        meta: ``(kq, 2)`` int32 of the quantized (non-RAW) blocks, in order.
        codes: ``(kq, n)`` unpacked codes of the quantized blocks (int32 when LOG16).
        raw: ``(k - kq, n)`` exact values of the RAW blocks.
    """
    out = torch.empty_like(r)
    is_raw = kinds == RAW
    if raw.numel():
        put(out, is_raw, raw)
    quant = ~is_raw
    if not bool(quant.any()):
        return out
    qkinds = kinds[quant]
    rq = take(r, quant)
    newq = torch.empty_like(rq)
    for kind in (LINEAR, LOG, LOG16):
        sel = qkinds == kind
        if not bool(sel.any()):
            continue
        every = bool(sel.all())
        rs, qs, ms = (rq, codes, meta) if every else (take(rq, sel), codes[sel], meta[sel])
        if kind == LINEAR:
            n = dequant_linear(rs, qs, ms[:, 0].view(torch.float32), ms[:, 1].view(torch.float32))
        else:
            n = dequant_log(rs, qs, ms[:, 0], ms[:, 1])
        if every:
            newq = n
        else:
            put(newq, sel, n)
    put(out, quant, newq)
    return out


def take(t: torch.Tensor, index: Any) -> torch.Tensor:
    """``t[index]`` through an integer view: float indexing may canonicalize NaN payloads."""
    return int_view(t)[index].view(t.dtype)


def put(t: torch.Tensor, index: Any, values: torch.Tensor) -> None:
    """``t[index] = values``, bit for bit (see :func:`take`)."""
    int_view(t)[index] = int_view(values)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(k, n)`` codes to ``(k, ceil(n * bits / 8))`` bytes, low bits first, per block."""
    if bits == 8:
        return codes
    per = 8 // bits
    k, n = codes.shape
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.view(k, (n + pad) // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes` for blocks of ``n`` elements."""
    if bits == 8:
        return packed
    per = 8 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    out = (packed[..., None] >> shifts) & mask
    return out.reshape(packed.shape[0], packed.shape[1] * per)[:, :n]


def pack_stream(
    kinds: torch.Tensor, codes: torch.Tensor, codes16: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """Codes of quantized blocks (rows, in block order) as stored: packed per block, LOG16
    blocks as little-endian uint16."""
    narrow = kinds != LOG16
    packed = pack_codes(codes[narrow] if codes16 is not None else codes, bits)
    if codes16 is None or bool(narrow.all()):
        return packed.reshape(-1)
    n = codes.shape[1]
    wide = codes16[~narrow].view(torch.uint8).view(-1, n, 4)[..., :2].reshape(-1, 2 * n)
    sizes = torch.where(narrow, packed.shape[1], 2 * n)
    starts = torch.cumsum(sizes, 0) - sizes
    out = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    out[starts[narrow][:, None] + torch.arange(packed.shape[1])] = packed
    out[starts[~narrow][:, None] + torch.arange(2 * n)] = wide
    return out


def stream_sizes(kinds: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Stored code bytes of each quantized block."""
    return torch.where(kinds == LOG16, 2 * n, (n * bits + 7) // 8)


def unpack_stream(data: torch.Tensor, kinds: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_stream`: ``(kq, n)`` codes, int32 when a LOG16 block is there."""
    per_block = (n * bits + 7) // 8
    narrow = kinds != LOG16
    if bool(narrow.all()):
        return unpack_codes(data.view(-1, per_block), bits, n)
    sizes = stream_sizes(kinds, n, bits)
    starts = torch.cumsum(sizes, 0) - sizes
    out = torch.empty((len(kinds), n), dtype=torch.int32)
    packed = data[starts[narrow][:, None] + torch.arange(per_block)]
    out[narrow] = unpack_codes(packed, bits, n).to(torch.int32)
    wide = data[starts[~narrow][:, None] + torch.arange(2 * n)].contiguous()
    out[~narrow] = wide.view(torch.int16).to(torch.int32) & 0xFFFF
    return out
