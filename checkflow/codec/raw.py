"""``exact``: the tensor's bytes as they are. Zero-copy on encode."""

from __future__ import annotations

from typing import Any

import torch

from checkflow.codec.base import Buffer, Codec, Encoded, tensor_bytes, tensor_from_bytes


class RawCodec(Codec):
    name = "exact"

    def encode(self, x: torch.Tensor, ref: Any | None = None) -> tuple[Encoded, None]:
        return Encoded([tensor_bytes(x)]), None

    def decode(
        self,
        data: Buffer,
        params: dict[str, Any],
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return tensor_from_bytes(data, dtype, shape)
