"""``codec.frames``: the header parse agrees with libzstd's, and decoding never goes past
the size it is given (the adversarial cases through real checkpoints are in
``tests/adversarial/test_decoding.py``)."""

from __future__ import annotations

import os

import pytest
import zstandard

from checkflow.codec.base import CodecError
from checkflow.codec.frames import (
    MIN_WINDOW,
    FrameHeader,
    check_header,
    decompress,
    frame_header,
    window_cap,
)

TIB = 1 << 40
CLAIMS_1_TIB = bytes.fromhex("28b52ffd") + b"\xe0" + TIB.to_bytes(8, "little") + b"\x01\x00\x00"
"""Magic, descriptor 0xE0 (8-byte content size, single segment), 2**40, an empty last raw
block: 16 bytes that python-zstandard's ``decompress`` answers with a 1 TiB allocation."""


@pytest.mark.parametrize("size", [0, 1, 255, 256, 300, 65_535, 65_536 + 256, 3 << 20])
@pytest.mark.parametrize("content_size", [True, False])
@pytest.mark.parametrize("level", [1, 19])
def test_the_header_parse_agrees_with_libzstd(size, content_size, level):
    """Every content-size width (1, 2 with its +256 offset, 4 bytes, none) and window
    form (single segment, descriptor byte) reads as ``zstandard.get_frame_parameters``."""
    data = os.urandom(size // 2) * 2 + b"\x01" * (size % 2)
    frame = zstandard.ZstdCompressor(level=level, write_content_size=content_size).compress(data)
    want = zstandard.get_frame_parameters(frame)
    got = frame_header(frame, "x")
    unknown = zstandard.CONTENTSIZE_UNKNOWN
    assert got.content_size == (None if want.content_size == unknown else want.content_size)
    assert got.window_size == want.window_size
    assert got.window_size <= window_cap(size)  # what checkflow writes is never refused
    assert bytes(decompress(frame, size, "x")) == data


def test_window_cap_is_the_next_power_of_two_and_at_least_1_mib():
    assert [window_cap(n) for n in (0, 1, MIN_WINDOW, MIN_WINDOW + 1, 3 << 20)] == [
        MIN_WINDOW,
        MIN_WINDOW,
        MIN_WINDOW,
        2 * MIN_WINDOW,
        4 << 20,
    ]


def test_a_frame_claiming_1_tib_is_refused_from_its_header():
    with pytest.raises(CodecError) as e:
        decompress(CLAIMS_1_TIB, 16_384, "plane 0")
    assert str(e.value) == (
        "plane 0 holds a zstd frame that declares 1099511627776 bytes, more than the 16384 expected"
    )


def test_a_frame_asking_for_a_window_above_the_cap_is_refused_from_its_header():
    """Level 19 on data of unknown size asks for an 8 MiB window: not for 16 KiB."""
    cobj = zstandard.ZstdCompressor(level=19, write_content_size=False).compressobj()
    frame = cobj.compress(b"\0" * 16_384) + cobj.flush()
    assert frame_header(frame, "x").window_size == 8 << 20
    with pytest.raises(CodecError, match=r"^s asks for|window, more than the 1048576 allowed"):
        check_header(frame, 16_384, "s")


def test_a_frame_without_a_size_is_stopped_one_byte_past_the_expected_size():
    """Level 1 keeps a 512 KiB window: the header passes, the output bound stops it."""
    frame = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * (4 << 20))
    assert frame_header(frame, "s") == FrameHeader(None, 512 << 10)
    out = memoryview(bytearray(16_385 + 7))
    with pytest.raises(CodecError, match=r"^s holds more than the 16384 bytes expected$"):
        decompress(frame, 16_384, "s", out)
    assert bytes(out[16_385:]) == b"\0" * 7  # nothing written past expected + 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "s is corrupt: not a zstd frame (it starts with nothing)"),
        (b"PK\x03\x04rest", "s is corrupt: not a zstd frame (it starts with 504b0304)"),
        (CLAIMS_1_TIB[:9], "s is corrupt: it ends inside its zstd frame header"),
        (CLAIMS_1_TIB[:4] + b"\x08", "s is corrupt: its zstd frame header has the reserved bit"),
    ],
    ids=["empty", "zip", "cut-header", "reserved-bit"],
)
def test_what_is_not_a_frame_header_is_named(data, message):
    with pytest.raises(CodecError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        decompress(data, 16, "s")


def test_concatenated_frames_decode_as_one_section_within_its_size():
    parts = [os.urandom(5_000), b"\x07" * 3_000]
    frames = b"".join(zstandard.ZstdCompressor().compress(p) for p in parts)
    assert bytes(decompress(frames, 8_000, "s")) == b"".join(parts)
    with pytest.raises(CodecError, match="^s holds more than the 7999 bytes expected$"):
        decompress(frames, 7_999, "s")
    with pytest.raises(CodecError, match="^s holds 8000 bytes, expected 8001$"):
        decompress(frames, 8_001, "s")


def test_a_refused_frame_leaves_nothing_behind_for_the_next_section():
    """Each thread reuses its decoder: after a bomb is stopped mid-frame, and after a cut
    frame, the next section of the same size decodes exactly."""
    good = os.urandom(10_000)
    frame = zstandard.ZstdCompressor().compress(good)
    cut = zstandard.ZstdCompressor(write_content_size=False).compress(good)[:-40]
    bomb = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1 << 22))
    for bad in (bomb, cut, CLAIMS_1_TIB):
        with pytest.raises(CodecError, match="^s "):
            decompress(bad, 10_000, "s")
        assert bytes(decompress(frame, 10_000, "s")) == good
