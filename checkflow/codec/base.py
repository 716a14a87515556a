"""The codec contract. Codecs are pure: tensors in, bytes out, and back. No storage, no threads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from checkflow.types import Buffer


class CodecError(ValueError):
    """Stored bytes cannot be decoded (wrong length, bad header, missing base)."""


@dataclass(slots=True)
class Encoded:
    """The result of encoding one chunk."""

    data: list[Buffer]
    """Stored bytes, in order; the persist writes them back to back."""
    params: dict[str, Any] = field(default_factory=dict)
    """JSON-serializable parameters the decoder needs."""
    delta: bool = False
    """True when decoding needs the reconstruction of the previous checkpoint (``base``)."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.data)


class Codec(ABC):
    """Encodes one chunk (a contiguous CPU tensor) to bytes and back.

    The persist worker calls, per chunk and per checkpoint, in this order::

        encoded, ref = codec.encode(x, ref)   # ref: None on a full checkpoint
        ... writes encoded.data ...

    and a restore calls ``codec.decode(data, params, dtype=, shape=, base=)`` where ``base``
    is the decoded tensor of the chunk's base step when ``encoded.delta`` was True.

    ``x`` is a host snapshot buffer that is reused by the next snapshot: ``encoded.data`` may
    alias it (it is written before the buffer is reused), but ``ref`` must not.
    Incremental codecs keep what they need of the previous checkpoint in ``ref`` (opaque to
    the caller, returned to them at the next checkpoint of the same chunk).
    """

    name: ClassVar[str]
    lossless: ClassVar[bool] = True
    incremental: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: torch.Tensor, ref: Any | None = None) -> tuple[Encoded, Any | None]:
        """Encode ``x``; return the stored form and the reference for the next checkpoint."""

    @abstractmethod
    def decode(
        self,
        data: Buffer,
        params: dict[str, Any],
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode stored bytes to a tensor of ``dtype`` and ``shape`` (it may alias ``data``)."""

    def decode_into(
        self,
        data: Buffer,
        params: dict[str, Any],
        out: torch.Tensor,
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode stored bytes into ``out`` (a contiguous tensor of the chunk's dtype and
        shape, e.g. the live tensor a restore fills) and return it.

        This default decodes, then copies; a codec that builds its output anyway overrides
        it to build it in ``out`` and save the new memory and the copy.
        """
        decoded = self.decode(data, params, dtype=out.dtype, shape=tuple(out.shape), base=base)
        with torch.no_grad():
            out.copy_(decoded)
        return out


def delta_base(
    name: str, base: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The base a delta chunk applies to, checked against the chunk's dtype and shape.

    Raises:
        CodecError: the base is missing or does not match.
    """
    if base is None:
        raise CodecError(f"{name} delta chunk needs its base checkpoint to decode")
    if tuple(base.shape) != tuple(shape) or base.dtype != dtype:
        raise CodecError(f"base is {tuple(base.shape)} {base.dtype}, chunk is {shape} {dtype}")
    return base


def tensor_bytes(x: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor."""
    if not x.is_contiguous():
        raise ValueError("codec input must be contiguous")
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()  # numpy arrays export the buffer protocol
    return memoryview(array).cast("B")


def tensor_from_bytes(data: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data`` (no copy when it is writable); checks the length."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    mv = memoryview(data).cast("B")
    if mv.nbytes != numel * itemsize:
        raise CodecError(
            f"stored data has {mv.nbytes} bytes, expected {numel * itemsize} "
            f"for {tuple(shape)} {dtype}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8).view(dtype).reshape(shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"unknown dtype {name!r} in manifest")
    return dtype
