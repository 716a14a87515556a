"""The ``zstd`` codec restores every dtype bit for bit, with the compiled unshuffle and with
numpy's (the fallback without a C compiler), and names a torn payload instead of garbling it."""

from __future__ import annotations

import pytest
import torch

from checkflow.codec import _native
from checkflow.codec.base import CodecError
from checkflow.codec.zstd import ZstdCodec, shuffle_bytes, unshuffle_bytes

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
