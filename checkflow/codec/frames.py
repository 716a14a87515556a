"""Bounded zstd decoding: stored bytes decode to at most the size the manifest declares.

A checkpoint is input, and python-zstandard trusts the frame it is given: its one-shot
``decompress`` allocates the content size the frame header states, whatever
``max_output_size`` says (a 16-byte frame claiming 1 TiB is a ``MemoryError``; one claiming
1 GiB is 1 GiB of memory before the length check), and its streaming decoder allocates the
window the header asks for (up to 128 MiB by default). So every decompression in
``checkflow.codec`` goes through :func:`decompress`, which

- reads the first frame's header (O(1): at most 18 bytes) and refuses a frame that declares
  more content than expected, or a window larger than :func:`window_cap` of it;
- decodes with a streaming decoder whose window is capped the same way, into a buffer of
  ``expected + 1`` bytes, so a frame without a content size that would decode to more is
  seen (one byte over) and refused, never decoded further;
- decodes concatenated frames one after the other (the writer makes one a section, a
  zstd tool may make more), all within the same output.

Decoding a section of ``expected`` bytes thus holds at most ``expected + 1`` bytes of output
and one window of at most ``window_cap(expected)`` bytes, beside the stored bytes. Pure: no
storage, no threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zstandard

from checkflow.codec.base import CodecError
from checkflow.types import Buffer

MAGIC = b"\x28\xb5\x2f\xfd"
"""The first four bytes of a zstd frame (0xFD2FB528, little-endian)."""
MIN_WINDOW = 1 << 20
"""The smallest window cap: a frame may always use 1 MiB (what zstd's low levels ask for
on data of unknown size), so small sections written by any zstd tool still decode."""
_MAX_HEADER = 18
"""Magic, descriptor, window byte, 4-byte dictionary id, 8-byte content size."""
_DICT_ID_BYTES = (0, 1, 2, 4)
_CONTENT_SIZE_BYTES = (0, 2, 4, 8)
_decoders = threading.local()
"""Per thread: a zstd decoder per window cap, reused section after section."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a zstd frame header promises about the frame."""

    content_size: int | None
    """The decoded size the frame states; None when it does not say."""
    window_size: int
    """The bytes of history the decoder must keep for it."""


def window_cap(expected: int) -> int:
    """The largest window a frame of ``expected`` decoded bytes may ask for: the next power
    of two >= ``expected``, and at least :data:`MIN_WINDOW`. zstd never needs a window
    larger than its content, and its compressor shrinks the window to a known source size
    (``ZstdCompressor.compress`` always knows it), so no frame checkflow wrote is refused."""
    return max(MIN_WINDOW, 1 << max(expected - 1, 0).bit_length())


def frame_header(data: Buffer, what: str) -> FrameHeader:
    """The header of the zstd frame at the start of ``data`` (RFC 8878, section 3.1.1).

    Raises:
        CodecError: ``data`` does not start with a complete zstd frame header.
    """
    head = bytes(memoryview(data).cast("B")[:_MAX_HEADER])
    if head[:4] != MAGIC:
        start = head[:4].hex() or "nothing"
        raise CodecError(f"{what} is corrupt: not a zstd frame (it starts with {start})")
    if len(head) < 5:
        raise CodecError(f"{what} is corrupt: it ends inside its zstd frame header")
    descriptor = head[4]
    single_segment = bool(descriptor & 0x20)
    if descriptor & 0x08:
        raise CodecError(f"{what} is corrupt: its zstd frame header has the reserved bit set")
    pos, window = 5, 0
    if not single_segment:
        if len(head) < 6:
            raise CodecError(f"{what} is corrupt: it ends inside its zstd frame header")
        exponent, mantissa = head[5] >> 3, head[5] & 7
        base = 1 << (10 + exponent)
        window, pos = base + (base >> 3) * mantissa, 6
    pos += _DICT_ID_BYTES[descriptor & 3]
    size_bytes = _CONTENT_SIZE_BYTES[descriptor >> 6] or (1 if single_segment else 0)
    if len(head) < pos + size_bytes:
        raise CodecError(f"{what} is corrupt: it ends inside its zstd frame header")
    if not size_bytes:
        return FrameHeader(None, window)
    size = int.from_bytes(head[pos : pos + size_bytes], "little") + (256 if size_bytes == 2 else 0)
    return FrameHeader(size, size if single_segment else window)


def check_header(data: Buffer, expected: int, what: str) -> None:
    """Refuse, before decoding, a first frame that states more than ``expected`` bytes of
    content or a window above ``window_cap(expected)``.

    Raises:
        CodecError: naming ``what``, the frame's claim and the bound.
    """
    header = frame_header(data, what)
    if header.content_size is not None and header.content_size > expected:
        raise CodecError(
            f"{what} holds a zstd frame that declares {header.content_size} bytes, "
            f"more than the {expected} expected"
        )
    cap = window_cap(expected)
    if header.window_size > cap:
        raise CodecError(
            f"{what} holds a zstd frame that asks for a {header.window_size}-byte window, "
            f"more than the {cap} allowed for {expected} bytes"
        )


def decompress(data: Buffer, expected: int, what: str, out: memoryview | None = None) -> memoryview:
    """The ``expected`` bytes that the zstd frame(s) in ``data`` decode to, writable: in
    ``out`` (a byte buffer of at least ``expected + 1`` bytes, e.g. a reused one) or in new
    memory. At most ``expected + 1`` bytes are ever decoded.

    Args:
        data: the stored frames.
        expected: the decoded size the manifest declares for them.
        what: the section's name in errors (``"zstd plane 3"``).
        out: where to decode.

    Raises:
        CodecError: naming ``what``: a header that claims too much, a corrupt frame, or
            frames that decode to more or fewer than ``expected`` bytes.
    """
    check_header(data, expected, what)
    if out is None:
        out = memoryview(bytearray(expected + 1))
    elif out.nbytes <= expected:
        raise ValueError(f"out holds {out.nbytes} bytes; decoding {expected} needs one more")
    cap, filled = window_cap(expected), 0
    try:
        reader = _decoder(cap).stream_reader(data, read_across_frames=True)
        while filled <= expected and (got := reader.readinto(out[filled : expected + 1])):
            filled += got
    except zstandard.ZstdError as e:
        _cached().pop(cap, None)
        raise CodecError(f"{what} is corrupt: {e}") from e
    if filled > expected:
        _cached().pop(cap, None)  # it may hold a window: let it go
        raise CodecError(f"{what} holds more than the {expected} bytes expected")
    if filled < expected:
        _cached().pop(cap, None)  # a cut frame leaves it mid-stream
        raise CodecError(f"{what} holds {filled} bytes, expected {expected}")
    return out[:expected]


def _decoder(cap: int) -> zstandard.ZstdDecompressor:
    """This thread's decoder of windows up to ``cap``. A new one costs ~40 us (its
    context), as much as decoding a small section; once it decoded a frame that states its
    size (all that checkflow writes) it holds ~96 KiB, and at most a ``cap`` window after
    one that does not (dropped when that one was refused)."""
    cache = _cached()
    dctx = cache.get(cap)
    if dctx is None:
        dctx = cache[cap] = zstandard.ZstdDecompressor(max_window_size=cap)
    return dctx


def _cached() -> dict[int, zstandard.ZstdDecompressor]:
    by_cap: dict[int, zstandard.ZstdDecompressor] = _decoders.__dict__.setdefault("by_cap", {})
    return by_cap
