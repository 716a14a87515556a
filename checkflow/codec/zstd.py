"""``zstd``: lossless; bytes are shuffled by significance first so float exponents compress."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import zstandard

from checkflow.codec import _native
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
    """Byte ``i`` of every element together, for ``i`` in 0..itemsize (blosc's shuffle).

    numpy's strided copy runs ~8x faster here than torch's ``t().contiguous()`` on uint8.
    """
    size = x.element_size()
    raw = tensor_bytes(x)
    if size == 1 or raw.nbytes == 0:
        return raw
    grouped = np.frombuffer(raw, dtype=np.uint8).reshape(-1, size)
    shuffled: Any = np.ascontiguousarray(grouped.T)  # numpy exports the buffer protocol
    return memoryview(shuffled).cast("B")


def unshuffle_bytes(data: Buffer, itemsize: int) -> memoryview:
    """The inverse of :func:`shuffle_bytes`, into a fresh writable buffer.

    The compiled kernel does it at memory speed (numpy's strided copy runs at ~170 MB/s, the
    bottleneck of a zstd restore); numpy is the fallback without a C compiler.
    """
    flat: Any = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1 or flat.size == 0:
        return memoryview(flat).cast("B")
    if flat.size % itemsize:
        raise CodecError(f"zstd data holds {flat.size} bytes, not whole {itemsize}-byte items")
    kernel = _native.load()
    if kernel is not None:
        unshuffled: Any = kernel.shuffle(flat, itemsize, inverse=True).numpy()
        return memoryview(unshuffled).cast("B")
    out = np.empty((flat.size // itemsize, itemsize), dtype=np.uint8)
    out[:] = flat.reshape(itemsize, -1).T
    result: Any = out
    return memoryview(result).cast("B")


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
        return tensor_from_bytes(unshuffle_bytes(raw, int(params.get("shuffle", 1))), dtype, shape)
