"""The ``zstd`` codec restores every dtype bit for bit, with the compiled unshuffle and with
numpy's (the fallback without a C compiler), and names a torn payload instead of garbling it."""

from __future__ import annotations

import pytest
import torch
import zstandard

from checkflow.codec import _native
from checkflow.codec.base import CodecError
from checkflow.codec.zstd import (
    DEFAULT_LEVEL,
    FAST_LEVEL,
    ZstdCodec,
    shuffle_bytes,
    unshuffle_bytes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...] = (37, 129)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
        x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
        return x
    return torch.randint(0, 200, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zstd_round_trip_is_bitwise_for_every_dtype(dtype):
    x = _tensor(dtype)
    codec = ZstdCodec()
    enc, _ = codec.encode(x)
    out = codec.decode(
        b"".join(bytes(memoryview(p)) for p in enc.data), enc.params, dtype=dtype, shape=x.shape
    )
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_compiled_unshuffle_gives_the_same_bytes_as_numpy(itemsize, monkeypatch):
    if _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    x = torch.randn(1000 * 8 // itemsize * 3, dtype=torch.float64).view(torch.uint8)
    shuffled = bytes(
        shuffle_bytes(x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]))
    )
    compiled = bytes(unshuffle_bytes(shuffled, itemsize))
    monkeypatch.setattr(_native, "load", lambda: None)
    fallback = bytes(unshuffle_bytes(shuffled, itemsize))
    assert compiled == fallback == bytes(x.numpy())


def test_a_payload_of_torn_items_is_a_codec_error():
    with pytest.raises(CodecError, match="not whole 4-byte items"):
        unshuffle_bytes(b"\x00" * 10, 4)


def _trained_like(numel: int) -> torch.Tensor:
    """fp32 values spread like trained weights: random mantissas, a few exponents."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(2)) * 0.02


def test_noise_planes_are_stored_raw_and_the_exponent_plane_as_4_bit_codes():
    x = _trained_like(600_000)  # planes of 600 kB: larger than the sample that decides
    enc, _ = ZstdCodec().encode(x)
    kinds = [entry[0] for entry in enc.params["planes"]]
    assert kinds == ["raw", "raw", "raw", "nib4"]
    sizes = [entry[1] for entry in enc.params["planes"]]
    assert sizes[:3] == [x.numel()] * 3 and sizes[3] < x.numel() // 2
    assert sum(memoryview(p).nbytes for p in enc.data) == sum(sizes)


def test_planes_that_compress_only_by_repeats_are_stored_in_fast_mode():
    """A young AdamW moment: noise with whole rows zero (units no gradient reached yet).
    Its mantissa planes shrink through the runs of zeros only, so they are stored in zstd's
    fast mode (literals not Huffman-coded), which decodes at near copy speed."""
    x = _trained_like(600_000).reshape(600, 1000)
    x[::3] = 0
    enc, _ = ZstdCodec().encode(x)
    assert [entry[0] for entry in enc.params["planes"]] == ["zstd", "zstd", "zstd", "nib4"]
    plane = bytes(shuffle_bytes(x)[: x.numel()])
    assert bytes(enc.data[0]) == zstandard.ZstdCompressor(level=FAST_LEVEL).compress(plane)
    out = ZstdCodec().decode(
        enc.data[0] + b"".join(enc.data[1:]), enc.params, dtype=x.dtype, shape=tuple(x.shape)
    )
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


def test_a_plane_of_skewed_small_values_keeps_its_huffman_coding():
    """Small integers (too many values for 4-bit codes) shrink by their skew alone, which
    fast mode cannot use: the plane keeps the codec's level."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(600_000, generator=gen).abs() * 12).clamp(max=255).to(torch.int32)
    enc, _ = ZstdCodec().encode(x)
    assert enc.params["planes"][0][0] == "zstd"
    plane = bytes(shuffle_bytes(x)[: x.numel()])
    assert bytes(enc.data[0]) == zstandard.ZstdCompressor(level=DEFAULT_LEVEL).compress(plane)
    assert enc.params["planes"][0][1] < 0.8 * len(
        zstandard.ZstdCompressor(level=FAST_LEVEL).compress(plane)
    )


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_planes_round_trip_bitwise_with_either_interleave(compiled, monkeypatch):
    if compiled and _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    if not compiled:
        monkeypatch.setattr(_native, "load", lambda: None)
    for x in (_trained_like(600_000), _tensor(torch.bfloat16, (300, 700)), _tensor(torch.float64)):
        enc, _ = ZstdCodec().encode(x)
        data = b"".join(bytes(memoryview(p)) for p in enc.data)
        out = ZstdCodec().decode(data, enc.params, dtype=x.dtype, shape=tuple(x.shape))
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))


def test_a_chunk_written_as_one_frame_before_planes_still_decodes():
    import zstandard

    x = _trained_like(50_000)
    frame = zstandard.ZstdCompressor(level=1).compress(shuffle_bytes(x))
    out = ZstdCodec().decode(frame, {"level": 1, "shuffle": 4}, dtype=x.dtype, shape=(50_000,))
    assert torch.equal(out, x)


def _planes(x: torch.Tensor) -> tuple[bytes, dict]:
    enc, _ = ZstdCodec().encode(x)
    return b"".join(bytes(memoryview(p)) for p in enc.data), enc.params


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d, p: (d[:-10], p), "ends after"),
        (lambda d, p: (d + b"\x00", p), "its planes"),
        (lambda d, p: (d, {**p, "planes": p["planes"][:3]}), "lists 3 byte planes, not 4"),
        (lambda d, p: (d, {**p, "planes": [["lz4", e[1]] for e in p["planes"]]}), "unknown kind"),
        (
            lambda d, p: (d[: -p["planes"][3][1]] + b"\xff" * p["planes"][3][1], p),
            "plane 3's 4-bit codes is corrupt: not a zstd frame",
        ),
    ],
    ids=["truncated", "trailing", "plane-count", "kind", "frame"],
)
def test_a_damaged_planes_chunk_is_a_codec_error_naming_what(damage, message):
    data, params = damage(*_planes(_trained_like(600_000)))
    with pytest.raises(CodecError, match=message):
        ZstdCodec().decode(data, params, dtype=torch.float32, shape=(600_000,))


def test_compiled_shuffle_gives_numpy_s_bytes(monkeypatch):
    if _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    x = _trained_like(10_001)
    compiled = bytes(shuffle_bytes(x))
    monkeypatch.setattr(_native, "load", lambda: None)
    assert compiled == bytes(shuffle_bytes(x))


@pytest.mark.parametrize("itemsize", [3, 16, 24])
def test_compiled_unshuffle_of_odd_and_wide_items_gives_numpy_s_bytes(itemsize, monkeypatch):
    if _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    shuffled = torch.randint(0, 256, (itemsize * 1001,), dtype=torch.uint8).numpy().tobytes()
    compiled = bytes(unshuffle_bytes(shuffled, itemsize))
    monkeypatch.setattr(_native, "load", lambda: None)
    assert compiled == bytes(unshuffle_bytes(shuffled, itemsize))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_into_fills_the_given_tensor_bitwise(dtype, compiled, monkeypatch):
    """A restore decodes straight into the live tensor: the same bits, in that memory."""
    if compiled and _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    if not compiled:
        monkeypatch.setattr(_native, "load", lambda: None)
    x = _trained_like(600_000) if dtype == torch.float32 else _tensor(dtype, (300, 700))
    data, params = _planes(x)
    live = torch.nn.Parameter(torch.zeros_like(x), requires_grad=dtype.is_floating_point)
    got = ZstdCodec().decode_into(data, params, live)
    assert got is live
    assert torch.equal(live.detach().view(torch.uint8), x.view(torch.uint8))


def test_decode_into_reuses_one_plane_buffer_per_thread_and_stays_exact():
    """Planes decompress into a buffer reused chunk after chunk; chunks of other sizes and
    dtypes in between never see each other's bytes."""
    chunks = [_trained_like(600_000), _tensor(torch.bfloat16, (300, 700)), _trained_like(5_000)]
    for x in chunks * 2:
        data, params = _planes(x)
        out = torch.empty_like(x)
        ZstdCodec().decode_into(data, params, out)
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("into", [False, True], ids=["decode", "decode_into"])
def test_a_plane_frame_of_the_wrong_length_is_a_codec_error(into):
    """A zstd frame that decodes to more or fewer bytes than its plane holds is named."""
    import zstandard

    x = _trained_like(600_000)
    data, params = _planes(x)
    kind, nbytes = params["planes"][3][:2]
    assert kind == "nib4"
    for wrong in (x.numel() - 1, x.numel() + 7):
        frame = zstandard.ZstdCompressor(level=1).compress(b"\x3f" * wrong)
        bad = data[: len(data) - nbytes] + frame
        layout = [*params["planes"][:3], ["zstd", len(frame)]]
        with pytest.raises(CodecError, match="plane 3 holds"):
            if into:
                ZstdCodec().decode_into(bad, {**params, "planes": layout}, torch.empty_like(x))
            else:
                ZstdCodec().decode(
                    bad, {**params, "planes": layout}, dtype=x.dtype, shape=(x.numel(),)
                )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_decode_into_a_misaligned_slice_of_a_live_tensor_is_bitwise(dtype, shift):
    """Large chunks are written past the cache in 16-byte stores: a chunk whose place in
    the live tensor starts at any element (a later chunk of a tensor) and ends anywhere
    is filled exactly, its neighbours untouched."""
    if _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    n = 700_001  # > 1 MiB of output for both dtypes, not a multiple of 16
    x = _trained_like(n).to(dtype)
    data, params = _planes(x)
    live = torch.full((n + 8,), 7.0, dtype=dtype)
    ZstdCodec().decode_into(data, params, live[shift : shift + n])
    assert torch.equal(live[shift : shift + n].view(torch.uint8), x.view(torch.uint8))
    outside = torch.cat([live[:shift], live[shift + n :]])
    assert torch.equal(outside, torch.full_like(outside, 7.0))


def _exponents(n: int, values: list[int], rare: list[int], rare_count: int) -> torch.Tensor:
    """fp32 elements whose top byte takes ``values`` and, ``rare_count`` times, ``rare``."""
    g = torch.Generator().manual_seed(5)
    top = torch.tensor(values, dtype=torch.int64)[torch.randint(len(values), (n,), generator=g)]
    where = torch.randperm(n, generator=g)[:rare_count]
    top[where] = torch.tensor(rare)[torch.randint(len(rare), (rare_count,), generator=g)]
    low = torch.randint(0, 1 << 24, (n,), generator=g)
    return ((top << 24) | low).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_4_bit_planes_with_escapes_round_trip_and_both_paths_write_the_same_bytes(
    compiled, monkeypatch
):
    """16 values or more: the 15 most frequent get codes, the others (first and last
    element included, an odd length) are listed apart and put back exactly."""
    if compiled and _native.load() is None:
        pytest.fail("the C kernel does not build here; the compiled path cannot be checked")
    x = _exponents(300_001, list(range(60, 75)), [3, 250], 900)
    x.view(torch.int32)[0] = 0x7F000000
    x.view(torch.int32)[-1] = -0x1000000
    data, params = _planes(x)
    if not compiled:
        monkeypatch.setattr(_native, "load", lambda: None)
        assert _planes(x) == (data, params)  # numpy packs the same bytes
    entry = params["planes"][3]
    assert entry[0] == "nib4" and entry[4] >= 900 and len(entry[2]) == 15
    out = ZstdCodec().decode(data, params, dtype=x.dtype, shape=tuple(x.shape))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))
    into = torch.empty_like(x)
    ZstdCodec().decode_into(data, params, into)
    assert torch.equal(into.view(torch.int32), x.view(torch.int32))


def test_a_plane_of_many_values_is_one_zstd_frame_as_before():
    """Too many escapes (over 1/64 of the plane) and the plane is left to plain zstd."""
    x = _exponents(300_000, list(range(60, 72)), list(range(100, 140)), 30_000)
    data, params = _planes(x)
    assert params["planes"][3][0] == "zstd"
    out = ZstdCodec().decode(data, params, dtype=x.dtype, shape=tuple(x.shape))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda e: [*e[:4], e[4] + 1], "does not add up"),
        (lambda e: e[:3], "is described as"),
        (lambda e: [*e[:2], [*e[2], 7, 8], *e[3:]], "as its values"),
        (lambda e: [*e[:2], [300], *e[3:]], "as its values"),
    ],
    ids=["escape-count", "short-entry", "sixteen-values", "value-range"],
)
def test_a_damaged_4_bit_plane_is_a_codec_error(damage, message):
    x = _exponents(300_001, list(range(60, 75)), [3], 50)
    data, params = _planes(x)
    layout = [*params["planes"][:3], damage(params["planes"][3])]
    with pytest.raises(CodecError, match=message):
        ZstdCodec().decode(data, {**params, "planes": layout}, dtype=x.dtype, shape=(300_001,))


def test_an_escape_outside_the_plane_is_a_codec_error():
    x = _exponents(300_001, list(range(60, 75)), [3], 50)
    data, params = _planes(x)
    entry = params["planes"][3]
    at = len(data) - 5 * entry[4]  # the first escape's position
    bad = data[:at] + (10**9).to_bytes(4, "little") + data[at + 4 :]
    with pytest.raises(CodecError, match="lists an escape at 1000000000"):
        ZstdCodec().decode(bad, params, dtype=x.dtype, shape=(300_001,))
