"""``zstd``: lossless; bytes are shuffled by significance first so float exponents compress."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import zstandard

from checkflow.codec import _native, frames, nibbles
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

    The compiled kernel runs ~4x faster than numpy's strided copy, itself ~8x faster than
    torch's ``t().contiguous()`` on uint8; numpy is the fallback without a C compiler.
    """
    size = x.element_size()
    raw = tensor_bytes(x)
    if size == 1 or raw.nbytes == 0:
        return raw
    kernel = _native.load()
    if kernel is not None:
        out: Any = kernel.shuffle(np.frombuffer(raw, dtype=np.uint8), size).numpy()
        return memoryview(out).cast("B")
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


SAMPLE_BYTES = 1 << 18
"""How much of a byte plane is compressed first to decide how the rest is stored."""
RAW_RATIO = 0.9
"""A plane whose sample shrinks to more than this fraction is stored raw: the low bytes of
float mantissas are noise, and compressing them saves a few percent for a full pass of
zstd on both sides (measured on trained fp32 weights and AdamW moments: 3 of 4 planes)."""
FAST_LEVEL = -1
"""zstd's fast mode: repeats (runs of zeros, repeated values) are found, literals are left
as they are instead of Huffman-coded."""
FAST_SLACK = 0.1
"""A plane is stored in fast mode unless the codec's level makes its sample smaller by more
than this fraction. Decoding Huffman-coded literals costs ~0.7 ms per MiB here, copying
raw ones ~0.1: for the mantissa planes of optimizer state with zeroed rows (a young AdamW
state) fast mode is 5 % larger (82.2 % of the plane against 78.3 %), 3x faster to encode
and 5x faster to decode (``benchmarks/zstd_planes.py``); a plane of skewed small integers
keeps its Huffman coding, which shrinks it far more than repeats do."""


def _pack_plane(
    cctx: zstandard.ZstdCompressor, fast: zstandard.ZstdCompressor, plane: memoryview
) -> tuple[list[Any], list[Buffer]]:
    """One byte plane as stored: its layout entry and bytes. A plane of few values (a float
    exponent plane) is ``["nib4", nbytes, values, frame_nbytes, escapes]``: zstd over its
    4-bit codes, then the escapes' positions (uint32) and values (:mod:`.nibbles`); other
    compressible ones ``["zstd", nbytes]``, one frame (``cctx``'s level, or ``fast`` when
    the level gains little, see ``FAST_SLACK``); the rest ``["raw", nbytes]``."""
    if plane.nbytes == 0:
        return ["raw", 0], [plane]
    sample = plane[:SAMPLE_BYTES]
    at_level = len(cctx.compress(sample)) if plane.nbytes > SAMPLE_BYTES else None
    if at_level is not None and at_level > RAW_RATIO * SAMPLE_BYTES:
        return ["raw", plane.nbytes], [plane]
    array: Any = np.frombuffer(plane, dtype=np.uint8)
    coded = nibbles.pack(array, array[:SAMPLE_BYTES])
    if coded is not None:
        codes: Any = coded.codes  # numpy arrays export the buffer protocol
        frame = cctx.compress(codes)
        parts: list[Buffer] = [
            frame,
            coded.positions.astype("<u4").tobytes(),
            coded.escaped.tobytes(),
        ]
        nbytes = sum(memoryview(b).nbytes for b in parts)
        if nbytes < plane.nbytes:
            return ["nib4", nbytes, coded.values, len(frame), int(coded.positions.size)], parts
    # A small plane (no sample taken) stays at the level: its decode time is noise.
    gains_little = (
        at_level is not None and len(fast.compress(sample)) <= (1 + FAST_SLACK) * at_level
    )
    packed = (fast if gains_little else cctx).compress(plane)
    if len(packed) < plane.nbytes:
        return ["zstd", len(packed)], [packed]
    return ["raw", plane.nbytes], [plane]


_scratch = threading.local()
"""Per decoding thread: the buffers its zstd planes are decompressed into, reused chunk
after chunk (a fresh buffer per plane costs a page fault per 4 KiB, as much as
decompressing). A restore's read threads end with it; a thread that decodes itself (one
read thread) keeps them: at most the compressible planes of its largest chunk."""


def _plane_buffer(index: int, nbytes: int) -> memoryview:
    """This thread's reusable buffer for byte plane ``index``, ``nbytes`` long."""
    buffers: dict[int, np.ndarray] = _scratch.__dict__.setdefault("planes", {})
    buf = buffers.get(index)
    if buf is None or buf.size < nbytes:
        buf = buffers[index] = np.empty(nbytes, dtype=np.uint8)
    view: Any = buf[:nbytes]
    return memoryview(view).cast("B")


def _decompress(frame: Buffer, nbytes: int, what: str, reuse: bool, slot: int) -> memoryview:
    """``nbytes`` decompressed from ``frame``: into this thread's buffer ``slot`` when
    ``reuse``, else new memory. Bounded (:mod:`.frames`): a frame that claims or decodes to
    more than ``nbytes`` is refused after at most ``nbytes + 1`` bytes."""
    out = _plane_buffer(slot, nbytes + 1) if reuse else None
    return frames.decompress(frame, nbytes, what, out)


def _decode_nibbles(
    stored: memoryview, entry: list[Any], nbytes: int, index: int, reuse: bool
) -> memoryview:
    """Plane ``index`` from its ``nib4`` parts (``_pack_plane``): the codes decompressed,
    expanded through their values, the escapes put back."""
    if not (len(entry) == 5 and isinstance(entry[3], int) and isinstance(entry[4], int)):
        raise CodecError(f"zstd plane {index} is described as {entry!r:.60}")
    frame_nbytes, escapes = entry[3], entry[4]
    if frame_nbytes < 0 or escapes < 0 or frame_nbytes + 5 * escapes != stored.nbytes:
        raise CodecError(
            f"zstd plane {index}: {entry!r:.60} does not add up to {stored.nbytes} bytes"
        )
    what = f"zstd plane {index}'s 4-bit codes"
    codes = _decompress(stored[:frame_nbytes], (nbytes + 1) // 2, what, reuse, slot=16 + index)
    out: Any = _plane_buffer(index, nbytes) if reuse else memoryview(bytearray(nbytes))
    at = frame_nbytes + 4 * escapes
    nibbles.unpack(
        entry[2], codes, stored[frame_nbytes:at], stored[at:], np.frombuffer(out, dtype=np.uint8)
    )
    return memoryview(out)


def _unpack_planes(
    data: Buffer, layout: list[Any], plane_nbytes: int, *, reuse: bool = False
) -> list[Buffer]:
    """The byte planes stored back to back in ``data`` as ``layout`` says, raw planes as
    views of ``data`` (no copy), zstd ones decompressed: into this thread's plane buffers
    when ``reuse`` (valid until its next call), else into new memory.

    Raises:
        CodecError: the layout does not describe ``data``, or a frame is corrupt.
    """
    view = memoryview(data).cast("B")
    planes: list[Buffer] = []
    pos = 0
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[1], int)):
            raise CodecError(f"zstd plane {len(planes)} is described as {entry!r:.40}")
        kind, nbytes = entry[0], entry[1]
        piece = view[pos : pos + nbytes]
        pos += nbytes
        if piece.nbytes != nbytes:
            raise CodecError(
                f"zstd data ends after {view.nbytes} bytes, inside plane {len(planes)}"
            )
        if kind == "zstd":
            piece = _decompress(
                piece, plane_nbytes, f"zstd plane {len(planes)}", reuse, len(planes)
            )
        elif kind == "nib4":
            piece = _decode_nibbles(piece, entry, plane_nbytes, len(planes), reuse)
        elif kind != "raw":
            raise CodecError(f"zstd plane {len(planes)} has unknown kind {kind!r:.20}")
        if piece.nbytes != plane_nbytes:
            raise CodecError(
                f"zstd plane {len(planes)} holds {piece.nbytes} bytes, expected {plane_nbytes}"
            )
        planes.append(piece)
    if pos != view.nbytes:
        raise CodecError(f"zstd data holds {view.nbytes} bytes, its planes {pos}")
    return planes


def interleave_planes(
    planes: list[Buffer], numel: int, itemsize: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Elements rebuilt from their ``itemsize`` byte planes, into ``out`` (contiguous, of
    ``numel`` elements of ``itemsize`` bytes) or a fresh uint8 tensor; returns it."""
    kernel = _native.load()
    if kernel is not None:
        return kernel.unshuffle_planes(planes, numel, itemsize, out)
    rows = np.empty((numel, itemsize), dtype=np.uint8)
    for k, plane in enumerate(planes):
        rows[:, k] = np.frombuffer(plane, dtype=np.uint8)
    flat = torch.from_numpy(rows.reshape(-1))
    if out is None:
        return flat
    out.reshape(-1).view(torch.uint8).copy_(flat)
    return out


class ZstdCodec(Codec):
    """Byte-shuffled, then each byte plane stored zstd-compressed or raw, whichever pays.

    Checkpoints written before planes were stored separately hold one zstd frame of all the
    shuffled bytes (no ``planes`` parameter); they decode as before.
    """

    name = "zstd"

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level

    def encode(self, x: torch.Tensor, ref: Any | None = None) -> tuple[Encoded, None]:
        itemsize = x.element_size()
        shuffled = shuffle_bytes(x)
        n = shuffled.nbytes // itemsize
        cctx = zstandard.ZstdCompressor(level=self.level)
        fast = zstandard.ZstdCompressor(level=FAST_LEVEL)
        planes = [shuffled[k * n : (k + 1) * n] for k in range(itemsize)]
        packed = [_pack_plane(cctx, fast, plane) for plane in planes]
        params = {"level": self.level, "shuffle": itemsize, "planes": [e for e, _ in packed]}
        return Encoded([b for _, parts in packed for b in parts], params), None

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
        layout = _plane_layout(params, dtype, itemsize)
        if layout is None:
            return _decode_one_frame(data, params, dtype, shape, numel * itemsize)
        planes = _unpack_planes(data, layout, numel, reuse=itemsize > 1)
        if itemsize == 1:
            return tensor_from_bytes(planes[0], dtype, shape)
        return interleave_planes(planes, numel, itemsize).view(dtype).reshape(shape)

    def decode_into(
        self,
        data: Buffer,
        params: dict[str, Any],
        out: torch.Tensor,
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The planes interleaved straight into ``out``: no new memory for the chunk."""
        itemsize = out.element_size()
        layout = _plane_layout(params, out.dtype, itemsize)
        if layout is None or itemsize == 1:
            return super().decode_into(data, params, out, base)
        planes = _unpack_planes(data, layout, out.numel(), reuse=True)
        with torch.no_grad():
            interleave_planes(planes, out.numel(), itemsize, out.detach())
        return out


def _plane_layout(params: dict[str, Any], dtype: torch.dtype, itemsize: int) -> list[Any] | None:
    """The chunk's list of byte planes; None for a chunk written before planes were stored
    apart (one frame).

    Raises:
        CodecError: the list is not one entry per byte of ``dtype``.
    """
    layout = params.get("planes")
    if layout is not None and (not isinstance(layout, list) or len(layout) != itemsize):
        count = len(layout) if isinstance(layout, list) else layout
        raise CodecError(f"zstd chunk of {dtype} lists {count!r:.20} byte planes, not {itemsize}")
    return layout


def _decode_one_frame(
    data: Buffer, params: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
) -> torch.Tensor:
    """A chunk written before byte planes were stored apart: one frame of all of them."""
    raw = frames.decompress(data, nbytes, "zstd data")
    return tensor_from_bytes(unshuffle_bytes(raw, int(params.get("shuffle", 1))), dtype, shape)
