"""``delta``: bitwise round trips along chains, sparse deltas, NaN payloads and bad input."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkflow.codec import CodecError, get_codec
from checkflow.codec.delta import DeltaCodec
from tests.codec._oracle import DTYPES, bits_equal, random_chunk, roundtrip, step_chunk

shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 3000)),
    st.tuples(st.integers(1, 60), st.integers(1, 300)),
    st.tuples(st.integers(1, 5), st.integers(1, 9), st.integers(1, 70)),
)


@settings(max_examples=30, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    block=st.sampled_from([1, 7, 64, 1024]),
    seed=st.integers(0, 2**31),
    frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    native=st.sampled_from([None, False]),
)
def test_delta_chain_restores_every_checkpoint_bitwise(shape, dtype, block, seed, frac, native):
    codec = DeltaCodec(block=block, native=native)
    x = random_chunk(shape, dtype, seed)
    enc, ref, out = roundtrip(codec, x, None, None)
    assert not enc.delta and bits_equal(out, x)
    for i in range(8):
        x = step_chunk(x, seed + i, frac, 1e-2, specials=i % 3 == 2)
        enc, ref, out = roundtrip(codec, x, ref, out)
        assert bits_equal(out, x), f"checkpoint {i} differs"


def test_delta_of_sparse_row_updates_stores_only_the_changed_rows():
    codec = DeltaCodec()
    x = torch.randn(4096, 64)
    enc, ref, prev = roundtrip(codec, x, None, None)
    for _ in range(5):
        x = x.clone()
        rows = torch.randperm(4096)[:80]  # 2 %
        x[rows] += 1e-3 * torch.randn(80, 64)
        enc, ref, prev = roundtrip(codec, x, ref, prev)
        assert enc.delta and enc.params["changed"] == 80
        assert bits_equal(prev, x)
        # 80 rows of 256 bytes, XOR'd and compressed, plus a bitmap: under 2 % of 1 MiB.
        assert enc.nbytes < 0.02 * x.numel() * 4


def test_unchanged_chunk_costs_a_few_bytes():
    codec = DeltaCodec()
    x = torch.randn(1000, 100)
    _, ref, prev = roundtrip(codec, x, None, None)
    enc, ref, out = roundtrip(codec, x.clone(), ref, prev)
    assert enc.delta and enc.params["changed"] == 0 and enc.nbytes < 64
    assert bits_equal(out, x)


def test_nan_payloads_infinities_and_negative_zero_come_back_bit_for_bit():
    codec = DeltaCodec(block=4)
    x = torch.zeros(64)
    _, ref, prev = roundtrip(codec, x, None, None)
    y = x.clone()
    yi = y.view(torch.int32)
    yi[3] = 0x7FC00123  # a NaN with a payload
    yi[9] = -0x00400001  # a negative NaN (0xFFBFFFFF)
    y[20], y[21], y[40] = float("inf"), float("-inf"), -0.0
    _, ref, out = roundtrip(codec, y, ref, prev)
    assert bits_equal(out, y)


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool])
def test_integer_and_bool_chunks_round_trip_exactly(dtype, native):
    codec = DeltaCodec(block=16, native=native)
    x = torch.randint(0, 2, (300,)).to(dtype)
    _, ref, prev = roundtrip(codec, x, None, None)
    y = x.clone()
    y[5] = ~y[5] if dtype == torch.bool else y[5] + 1
    enc, _, out = roundtrip(codec, y, ref, prev)
    assert torch.equal(out, y)


def test_a_new_shape_restarts_the_chain_with_a_full_encoding():
    codec = DeltaCodec()
    _, ref, _ = roundtrip(codec, torch.randn(10, 10), None, None)
    enc, _, out = roundtrip(codec, torch.ones(5, 10), ref, None)
    assert not enc.delta and torch.equal(out, torch.ones(5, 10))


def test_decoding_a_delta_without_its_base_or_from_torn_bytes_fails_clearly():
    codec = DeltaCodec()
    x = torch.randn(200, 32)
    enc, ref = codec.encode(x, None)
    y = x.clone()
    y[3] += 1
    enc, ref = codec.encode(y, ref)
    data = b"".join(bytes(b) for b in enc.data)
    with pytest.raises(CodecError, match="base"):
        codec.decode(data, enc.params, dtype=x.dtype, shape=(200, 32))
    with pytest.raises(CodecError):
        codec.decode(data[:-3], enc.params, dtype=x.dtype, shape=(200, 32), base=x)
    with pytest.raises(CodecError, match="base is"):
        codec.decode(data, enc.params, dtype=x.dtype, shape=(200, 32), base=x[:100])


def test_registry_resolves_delta_as_an_exact_incremental_codec():
    codec = get_codec("delta")
    assert isinstance(codec, DeltaCodec) and codec.incremental and codec.lossless


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_native_and_torch_delta_write_the_same_bytes_and_read_each_other(dtype):
    fast, slow = DeltaCodec(block=50, native=True), DeltaCodec(block=50, native=False)
    x = (torch.randn(40, 120) * 50).to(dtype)
    _, rf = fast.encode(x, None)
    _, rs = slow.encode(x, None)
    y = x.clone()
    y[3:9] = (y[3:9].double() * 1.01 + 1).to(dtype)
    ef, _ = fast.encode(y, rf)
    es, _ = slow.encode(y, rs)
    data = b"".join(bytes(b) for b in ef.data)
    assert ef.delta and ef.params == es.params and data == b"".join(bytes(b) for b in es.data)
    for codec in (fast, slow):
        out = codec.decode(data, ef.params, dtype=dtype, shape=(40, 120), base=x)
        assert bits_equal(out, y)
