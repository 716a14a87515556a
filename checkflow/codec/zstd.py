"""``zstd``: lossless; bytes are shuffled by significance first so float exponents compress."""

from __future__ import annotations

from typing import Any

import torch
import zstandard

from checkflow.codec.base import (
    Buffer,
    Codec,
    CodecError,
    Encoded,
    tensor_bytes,
    tensor_from_bytes,
)

DEFAULT_LEVEL = 1


def shuffle_bytes(x: torch.Tensor) -> memoryview:
    """Byte ``i`` of every element together, for ``i`` in 0..itemsize (blosc's shuffle)."""
    size = x.element_size()
    raw = x.reshape(-1).view(torch.uint8)
    if size == 1 or raw.numel() == 0:
        return tensor_bytes(raw)
    return tensor_bytes(raw.view(-1, size).t().contiguous())


def unshuffle_bytes(data: Buffer, itemsize: int) -> torch.Tensor:
    raw = tensor_from_bytes(data, torch.uint8, (memoryview(data).nbytes,))
    if itemsize == 1 or raw.numel() == 0:
        return raw
    return raw.view(itemsize, -1).t().contiguous().view(-1)


class ZstdCodec(Codec):
    name = "zstd"

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level

    def encode(self, x: torch.Tensor, ref: Any | None = None) -> tuple[Encoded, None]:
        payload = zstandard.ZstdCompressor(level=self.level).compress(shuffle_bytes(x))
        return Encoded([payload], {"level": self.level, "shuffle": x.element_size()}), None

    def decode(
        self,
        data: Buffer,
        params: dict[str, Any],
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=numel * itemsize)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd data is corrupt: {e}") from e
        flat = unshuffle_bytes(bytearray(raw), int(params.get("shuffle", 1)))
        return tensor_from_bytes(tensor_bytes(flat), dtype, shape)
