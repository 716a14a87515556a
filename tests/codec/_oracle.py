"""Helpers of the codec tests: random chunks and an independent check of the error bound."""

from __future__ import annotations

import math

import torch

from checkflow.codec import Codec
from checkflow.codec.blocks import block_layout, int_view

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def roundtrip(codec: Codec, x: torch.Tensor, ref, base: torch.Tensor | None):
    """Encode ``x``, decode it from the concatenated bytes as a restore would."""
    enc, ref = codec.encode(x, ref)
    data = b"".join(bytes(memoryview(b)) for b in enc.data)
    assert len(data) == enc.nbytes
    out = codec.decode(
        data, enc.params, dtype=x.dtype, shape=tuple(x.shape), base=base if enc.delta else None
    )
    return enc, ref, out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(int_view(a.reshape(-1)), int_view(b.reshape(-1)))


def random_chunk(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, kind: str = "normal"
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "positive":  # many decades, like Adam's exp_avg_sq
        x = torch.exp(torch.randn(shape, generator=g) * 6 - 14)
    elif kind == "constant":
        x = torch.full(shape, 0.375)
    else:
        x = torch.randn(shape, generator=g)
    return x.to(dtype)


def step_chunk(
    x: torch.Tensor, seed: int, frac: float, scale: float, specials: bool
) -> torch.Tensor:
    """A next snapshot: a fraction of the elements moves (relatively), maybe NaN/inf added."""
    g = torch.Generator().manual_seed(seed)
    flat = x.reshape(-1).to(torch.float32).clone()
    if flat.numel():
        pick = torch.rand(flat.shape, generator=g) < frac
        noise = torch.randn(flat.shape, generator=g) * scale
        flat = torch.where(pick, flat + noise * (flat.abs() + 1e-3), flat)
        if specials:
            i = int(torch.randint(0, flat.numel(), (1,), generator=g))
            flat[i] = [math.nan, math.inf, -math.inf, 0.0][seed % 4]
    return flat.to(x.dtype).reshape(x.shape)


def check_quant_bound(
    x: torch.Tensor,
    prev_x: torch.Tensor,
    prev_r: torch.Tensor,
    new_r: torch.Tensor,
    bits: int,
    block: int,
    min_row: int,
    log_space: bool = True,
) -> None:
    """Every block of ``new_r`` is what the format promises, computed without the codec.

    Unchanged blocks (same bits as ``prev_x``) keep ``prev_r`` exactly. A changed block is
    either exact (RAW) or within half a step of ``x``: LINEAR when a value is negative,
    ``scale = (max d - min d) / levels`` with ``d = x - prev_r``; LOG (all >= 0) on the
    integer bit patterns, ``step = ceil(span / levels)`` units in the last place.
    """
    levels = (1 << bits) - 1
    layout = block_layout(tuple(x.shape), block, min_row)
    eps_t = torch.finfo(x.dtype).eps
    eps32 = torch.finfo(torch.float32).eps
    tiny = torch.finfo(x.dtype).smallest_normal
    flats = [t.reshape(-1) for t in (x, prev_x, prev_r, new_r)]
    for region in layout.regions:
        # (blocks, blen) copies of every block of the region, in the four tensors.
        xb, pb, rb, nb = (region.view(t).reshape(-1, region.blen) for t in flats)
        xi, pi, ri, ni = (int_view(t).to(torch.int64) for t in (xb, pb, rb, nb))
        changed = (xi != pi).any(dim=1)
        assert bool((ni[~changed] == ri[~changed]).all()), "an unchanged block was rewritten"
        exact = (ni == xi).all(dim=1)
        check = changed & ~exact
        finite = torch.isfinite(xb).all(dim=1) & torch.isfinite(rb).all(dim=1)
        assert bool(finite[check].all()), "a block with NaN/inf was not stored exactly"
        nonneg = (xi >= 0).all(dim=1) & (ri >= 0).all(dim=1)
        is_log = check & nonneg if log_space else torch.zeros_like(check)
        if bool(is_log.any()):
            d = (xi - ri)[is_log]
            step = -(-(d.amax(dim=1) - d.amin(dim=1)) // levels)
            err = (ni - xi)[is_log].abs().amax(dim=1)
            assert bool((err <= step // 2).all()), f"log blocks off by {err - step // 2} ulp"
            assert bool((ni[is_log] >= 0).all()), "a log block turned negative"
        lin = check & ~is_log
        if bool(lin.any()):
            xf, rf, nf = xb[lin].float(), rb[lin].float(), nb[lin].float()
            d = xf - rf
            lo, hi = d.amin(dim=1, keepdim=True), d.amax(dim=1, keepdim=True)
            scale = (hi - lo) / levels
            tol = (
                scale / 2 * (1 + 1e-5)
                + 4 * eps32 * (rf.abs() + lo.abs() + hi.abs())
                + eps_t * (xf.abs() + scale)
                + tiny
            )
            worst = float(((nf - xf).abs() - tol).max())
            assert worst <= 0, f"a linear block's error exceeds half a step by {worst}"
