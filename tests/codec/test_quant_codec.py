"""``q8``/``q4``/``q2``: the error bound holds along chains, no drift, exact full checkpoints,
and the compiled kernel is bit-identical to the torch path both ways."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkflow.codec import CodecError, _native, get_codec
from checkflow.codec.blocks import int_view
from checkflow.codec.quant import MIN_ROW, Q2Codec, Q4Codec, Q8Codec
from tests.codec._oracle import (
    DTYPES,
    bits_equal,
    check_quant_bound,
    random_chunk,
    roundtrip,
    step_chunk,
)

CODECS = {"q8": Q8Codec, "q4": Q4Codec, "q2": Q2Codec}
shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(1, 2000)),
    st.tuples(st.integers(1, 40), st.integers(1, 300)),
    st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 50)),
)


def _chain(codec, x, steps, seed, frac, scale, specials, block):
    enc, ref, out = roundtrip(codec, x, None, None)
    assert not enc.delta and bits_equal(out, x), "a full checkpoint must be exact"
    prev_x = x
    for i in range(steps):
        x = step_chunk(prev_x, seed + i, frac, scale, specials and i % 4 == 1)
        enc, ref, new = roundtrip(codec, x, ref, out)
        assert bits_equal(new, ref.recon.view(x.dtype).reshape(x.shape)), (
            "encoder's reconstruction differs from what a restore decodes"
        )
        if enc.delta:
            check_quant_bound(x, prev_x, out, new, codec.bits, block, MIN_ROW)
        else:
            assert bits_equal(new, x)
        prev_x, out = x, new
    return x, out


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(CODECS)),
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    block=st.sampled_from([1, 5, 64, 256]),
    kind=st.sampled_from(["normal", "positive", "constant"]),
    frac=st.sampled_from([0.02, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
    native=st.sampled_from([None, False]),
)
def test_quantized_chain_stays_within_half_a_step_of_the_true_values(
    name, shape, dtype, block, kind, frac, seed, native
):
    codec = CODECS[name](block=block, native=native)
    _chain(codec, random_chunk(shape, dtype, seed, kind), 6, seed, frac, 0.05, True, block)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fifty_deltas_do_not_drift(name, dtype):
    codec = CODECS[name]()
    x0 = random_chunk((64, 200), dtype, 7)
    x, out = _chain(codec, x0, 50, 11, 0.3, 0.02, False, 256)
    # The bound is per step, not per chain: the error after 50 deltas is the error of one.
    err = (out.float() - x.float()).abs().max()
    span = (x.float() - x0.float()).abs().max()
    assert float(err) <= float(span) / ((1 << codec.bits) - 1) + 1e-2 * float(x.abs().max())


def test_adam_second_moments_keep_relative_error_small_and_stay_positive():
    torch.manual_seed(0)
    v = torch.exp(torch.randn(256, 512) * 4 - 18)  # exp_avg_sq: ~1e-12 .. 1e-4
    codec = Q8Codec()
    _, ref, out = roundtrip(codec, v, None, None)
    for _ in range(20):
        g = torch.randn_like(v) * v.sqrt() * 3  # gradients on the scale of sqrt(v), spiky
        v = 0.999 * v + 0.001 * g * g
        _, ref, out = roundtrip(codec, v, ref, out)
        rel = ((out - v).abs() / v).max()
        assert float(rel) < 3e-3 and bool((out > 0).all())


def test_entries_leaving_zero_get_16_bit_codes_and_keep_q8_within_one_percent():
    # Dead units: exp_avg_sq rows stay exactly 0 until their first gradient; a block mixing
    # such an entry with living ones spans ~90 octaves of bits, far too wide for 8-bit codes.
    torch.manual_seed(3)
    v = torch.exp(torch.randn(64, 256) * 2 - 16)
    v[:, ::7] = 0.0
    v2 = v * (1 + 0.2 * torch.rand_like(v))
    v2[:, ::14] = 1e-9 * torch.rand(64, 19)  # half of the zeros come alive
    datas = []
    for native in (None, False):
        codec = Q8Codec(native=native)
        _, ref, out = roundtrip(codec, v, None, None)
        enc, ref, out = roundtrip(codec, v2, ref, out)
        datas.append(b"".join(bytes(b) for b in enc.data))
        assert enc.delta and enc.params["changed"] == 64
        alive = v2 > 0
        assert float(((out - v2).abs() / v2)[alive].max()) <= 0.01
        assert float(out[~alive].max()) < 1e-30  # dead entries stay ~0 (subnormal at most)
        # 16-bit codes cost 2 bytes an entry: far less than exact blocks (4).
        assert enc.nbytes < 0.6 * v.numel() * 4
    assert datas[0] == datas[1]


def test_q4_second_moments_never_become_zero_or_negative():
    torch.manual_seed(1)
    v = torch.exp(torch.randn(64, 256) * 5 - 20)
    codec = Q4Codec()
    _, ref, out = roundtrip(codec, v, None, None)
    for _ in range(10):
        v = 0.99 * v + 0.01 * torch.randn_like(v) ** 2 * 1e-6
        _, ref, out = roundtrip(codec, v, ref, out)
        assert bool((out > 0).all())


def test_sparse_updates_stay_sparse_because_blocks_are_chosen_against_the_snapshot():
    codec = Q8Codec()
    x = torch.randn(2000, 64)
    _, ref, out = roundtrip(codec, x, None, None)
    sizes = []
    for _ in range(10):
        x = x.clone()
        x[torch.randperm(2000)[:40]] += 0.1 * torch.randn(40, 64)
        enc, ref, out = roundtrip(codec, x, ref, out)
        assert enc.params["changed"] <= 40  # residuals of earlier rows are not re-sent
        sizes.append(enc.nbytes)
    assert max(sizes) < 40 * (64 + 8) + 200


def test_nan_and_inf_are_stored_exactly_and_the_rest_of_the_chunk_still_quantizes():
    codec = Q4Codec(block=8)
    x = torch.randn(128)
    _, ref, out = roundtrip(codec, x, None, None)
    y = x + 0.01
    y[3], y[50], y[51] = float("nan"), float("inf"), float("-inf")
    enc, ref, out = roundtrip(codec, y, ref, out)
    assert bits_equal(out[:8], y[:8]) and bits_equal(out[48:56], y[48:56])
    assert enc.nbytes < y.numel() * 4
    z = y.clone()
    z[3] = 1.0  # leaving NaN: the block is re-encoded from an exact base
    enc, ref, out = roundtrip(codec, z, ref, out)
    assert torch.isfinite(out[:8]).all()


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payloads_survive_a_quantized_chain_bit_for_bit(dtype, native):
    codec = Q8Codec(block=4, native=native)
    x = torch.randn(64).to(dtype)
    _, ref, out = roundtrip(codec, x, None, None)
    y = x.clone()
    yi = int_view(y)
    yi[5] = -1  # all-ones bits: a negative NaN with a full payload
    yi[22] = 0x7F81 if dtype == torch.bfloat16 else (0x7C01 if dtype == torch.float16 else yi[22])
    enc, ref, out = roundtrip(codec, y, ref, out)
    assert bits_equal(out[4:8], y[4:8]) and bits_equal(out[20:24], y[20:24])


def test_huge_values_whose_delta_overflows_fp32_are_stored_exactly():
    codec = Q8Codec(block=4)
    x = torch.tensor([3e38, -3e38, 1.0, 2.0])
    _, ref, out = roundtrip(codec, x, None, None)
    y = torch.tensor([-3e38, 3e38, 1.5, 2.0])
    _, ref, out = roundtrip(codec, y, ref, out)
    assert bits_equal(out, y)


def test_fp16_reconstruction_never_overflows_to_inf():
    codec = Q2Codec(block=4)
    x = torch.tensor([65504.0, -65504.0, 60000.0, 0.0], dtype=torch.float16)
    _, ref, out = roundtrip(codec, x, None, None)
    y = torch.tensor([65504.0, 65504.0, -65504.0, 1.0], dtype=torch.float16)
    _, ref, out = roundtrip(codec, y, ref, out)
    assert torch.isfinite(out).all()


def test_unsupported_float_dtype_is_stored_exactly():
    codec = Q8Codec()
    x = torch.randn(100, dtype=torch.float64)
    enc, ref, out = roundtrip(codec, x, None, None)
    enc, ref, out = roundtrip(codec, x + 1, ref, out)
    assert not enc.delta and torch.equal(out, x + 1)


def test_a_delta_is_never_bigger_than_the_exact_chunk():
    codec = Q8Codec()
    x = torch.randn(3)
    _, ref, out = roundtrip(codec, x, None, None)
    enc, ref, out = roundtrip(codec, x + 1, ref, out)
    assert not enc.delta and enc.nbytes == 12 and torch.equal(out, x + 1)


def test_dense_q8_and_q4_cost_about_bits_over_32_plus_scales():
    x = torch.randn(512, 2048)
    for codec, limit in ((Q8Codec(), 0.26), (Q4Codec(), 0.135)):
        _, ref, out = roundtrip(codec, x, None, None)
        enc, _, _ = roundtrip(codec, x + 1e-3 * torch.randn_like(x), ref, out)
        assert enc.delta and enc.nbytes / (x.numel() * 4) < limit


def test_decode_rejects_missing_base_and_torn_sections():
    codec = Q8Codec()
    x = torch.randn(100, 64)
    _, ref = codec.encode(x, None)
    enc, _ = codec.encode(x + 1e-3 * torch.randn_like(x), ref)
    data = b"".join(bytes(b) for b in enc.data)
    with pytest.raises(CodecError, match="base"):
        codec.decode(data, enc.params, dtype=x.dtype, shape=(100, 64))
    for native in (None, False):
        c = Q8Codec(native=native)
        with pytest.raises(CodecError):
            c.decode(data[:-5], enc.params, dtype=x.dtype, shape=(100, 64), base=x)
        bad = dict(enc.params, sections=[*enc.params["sections"][:3], 10, 0])
        with pytest.raises(CodecError):
            c.decode(data[: sum(bad["sections"])], bad, dtype=x.dtype, shape=(100, 64), base=x)


def test_registry_resolves_lossy_incremental_codecs():
    for name in ("q8", "q4", "q2"):
        codec = get_codec(name)
        assert codec.incremental and not codec.lossless and codec.name == name


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_native_kernel_and_torch_path_write_and_read_the_same_bytes(dtype, bits):
    kernel = _native.load()
    assert kernel is not None, "a C compiler is present, the kernel must build"
    if not kernel.supports(dtype):
        pytest.skip(f"this compiler has no _Float16: {dtype} uses the torch path only")
    cls = {8: Q8Codec, 4: Q4Codec, 2: Q2Codec}[bits]
    fast, slow = cls(native=True, block=100), cls(native=False, block=100)
    for kind in ("normal", "positive"):
        x = random_chunk((37, 250), dtype, bits, kind)
        _, rf = fast.encode(x, None)
        _, rs = slow.encode(x, None)
        base = x
        for i in range(5):
            x = step_chunk(x, i, 0.4, 0.05, specials=i == 2)
            ef, rf = fast.encode(x, rf)
            es, rs = slow.encode(x, rs)
            assert ef.params == es.params
            data = b"".join(bytes(b) for b in ef.data)
            assert data == b"".join(bytes(b) for b in es.data)
            a = fast.decode(data, ef.params, dtype=dtype, shape=tuple(x.shape), base=base)
            b = slow.decode(data, ef.params, dtype=dtype, shape=tuple(x.shape), base=base)
            assert bits_equal(a, b) and bits_equal(a, rf.recon.view(dtype).reshape(x.shape))
            base = a
