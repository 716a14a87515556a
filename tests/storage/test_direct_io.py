"""Local checkpoint files written around the page cache (O_DIRECT) hold exactly their parts.

The direct writer copies parts into an aligned bounce buffer and writes whole aligned
blocks, then the unaligned tail with O_DIRECT off: every size below crosses one of those
edges. A filesystem that refuses a direct write (EINVAL from the kernel) gets a plain write
of the whole file instead.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from checkflow import knobs
from checkflow.codec.base import tensor_bytes
from checkflow.storage import Storage, StorageError, direct
from checkflow.write.datafiles import DataFileWriter

pytestmark = pytest.mark.skipif(not direct.direct_io_supported(), reason="no O_DIRECT here")


def _parts(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Blocks of 3 pages, so that small test files span several blocks and a tail."""
    monkeypatch.setattr(direct, "BLOCK_BYTES", 3 * direct.ALIGN)
    monkeypatch.setattr(direct._local, "bounce", None, raising=False)
    yield
    direct._local.bounce = None


@pytest.mark.parametrize(
    "sizes",
    [
        [],  # empty file
        [1],  # only a tail
        [direct.ALIGN],  # exactly one aligned piece, no tail
        [3 * direct.ALIGN],  # exactly one block
        [3 * direct.ALIGN + 1],  # a block and a one-byte tail
        [5000, 7, 12288, 1, 40000],  # parts that straddle blocks and pages
    ],
    ids=["empty", "tail-only", "one-page", "one-block", "block+1", "straddling"],
)
def test_direct_write_stores_the_parts_back_to_back(
    tmp_path: os.PathLike, small_blocks: None, sizes: list[int]
) -> None:
    parts = _parts(sizes)
    path = os.path.join(tmp_path, "rank-00000-000.chunks")

    direct.write_parts(path, [memoryview(p) for p in parts])

    with open(path, "rb") as f:
        assert f.read() == b"".join(parts)
    assert os.path.getsize(path) == sum(sizes)
    assert direct._device(path) not in direct._refused  # the direct path was taken


def test_storage_put_writes_directly_and_reads_back_the_same_bytes(tmp_path: os.PathLike) -> None:
    parts = _parts([9 << 20, 123, 1 << 20])  # more than one 8 MiB block, and a tail
    storage = Storage(str(tmp_path))

    with knobs.override(CHECKFLOW_DIRECT_IO=1):
        written = storage.put("step-000000001/rank-00000-000.chunks", parts)

    assert written == sum(len(p) for p in parts)
    assert bytes(storage.read("step-000000001/rank-00000-000.chunks")) == b"".join(parts)
    middle = storage.read("step-000000001/rank-00000-000.chunks", 9 << 20, (9 << 20) + 123)
    assert bytes(middle) == parts[1]


def test_a_refused_direct_write_falls_back_to_a_plain_write_of_the_whole_file(
    tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A block that is not a multiple of any device block size: the kernel answers EINVAL
    # to the first direct write, as a filesystem without O_DIRECT support would.
    monkeypatch.setattr(direct, "BLOCK_BYTES", direct.ALIGN + 100)
    monkeypatch.setattr(direct._local, "bounce", None, raising=False)
    parts = _parts([3 * direct.ALIGN, 77])
    path = os.path.join(tmp_path, "data.chunks")
    try:
        direct.write_parts(path, [memoryview(p) for p in parts])

        with open(path, "rb") as f:
            assert f.read() == b"".join(parts)
        assert direct._device(path) in direct._refused  # later files skip O_DIRECT here
    finally:
        direct._refused.discard(direct._device(path))
        direct._local.bounce = None


def test_direct_io_off_writes_through_the_page_cache(tmp_path: os.PathLike) -> None:
    parts = _parts([5000, 3])
    path = os.path.join(tmp_path, "data.chunks")

    direct.write_parts(path, [memoryview(p) for p in parts], direct=False)

    with open(path, "rb") as f:
        assert f.read() == b"".join(parts)


def test_the_direct_io_knob_reads_common_spellings() -> None:
    for value, expected in [("1", True), ("0", False), ("off", False), ("true", True)]:
        with knobs.override(CHECKFLOW_DIRECT_IO=value):
            assert knobs.direct_io() is expected


@pytest.mark.parametrize("lead", [0, 100, direct.ALIGN - 1], ids=["at-0", "at-100", "at-4095"])
def test_a_part_whose_memory_lines_up_is_written_from_its_own_memory_correctly(
    tmp_path: os.PathLike, small_blocks: None, lead: int
) -> None:
    # An mmap is page-aligned: a slice starting `lead` bytes in lines up with a file
    # position of `lead` (the direct path) and not with 0 (the bounce path) unless lead == 0.
    size = direct.DIRECT_MIN_BYTES + 3 * direct.ALIGN + 5
    backing = mmap.mmap(-1, lead + size)
    backing[lead:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    part = memoryview(backing)[lead:]
    head = memoryview(bytes(range(256)) * 64)[:lead]  # puts the part at file position `lead`
    path = os.path.join(tmp_path, "aligned.chunks")

    direct.write_parts(path, [head, part])
    direct.write_parts(path + ".0", [part])  # at position 0: lines up only when lead == 0

    with open(path, "rb") as f:
        assert f.read() == head.tobytes() + part.tobytes()
    with open(path + ".0", "rb") as f:
        assert f.read() == part.tobytes()
    part.release()
    backing.close()


def test_data_files_line_large_chunks_up_with_their_buffers_and_count_no_padding(
    tmp_path: os.PathLike,
) -> None:
    storage = Storage(str(tmp_path))
    tensors = [torch.randn(300, 257) for _ in range(3)]  # ~300 KiB each, odd sizes
    small = b"skeleton"
    with knobs.override(CHECKFLOW_DIRECT_IO=1):
        writer = DataFileWriter(storage, "step-000000001", 0)
        placed = [writer.add([tensor_bytes(t)]) for t in tensors]
        small_at = writer.add([small])
        writer.flush()

    for t, (_, offset) in zip(tensors, placed, strict=True):
        assert offset % direct.ALIGN == t.data_ptr() % direct.ALIGN
        back = storage.read(f"step-000000001/{placed[0][0]}", offset, offset + t.nbytes)
        assert bytes(back) == tensor_bytes(t).tobytes()
    assert bytes(storage.read(f"step-000000001/{small_at[0]}", small_at[1])) == small
    assert writer.total == sum(t.nbytes for t in tensors) + len(small)


# -- reads past the page cache (a restore bound for a device) ---------------------------------


def _file_of(tmp_path: os.PathLike, size: int) -> tuple[Storage, bytes]:
    data = _parts([size], seed=3)[0]
    with open(os.path.join(tmp_path, "data.chunks"), "wb") as f:
        f.write(data)
    storage = Storage(str(tmp_path))
    storage.map_min_bytes = 1  # every ranged read is a chunk read
    return storage, data


def test_direct_reads_return_exactly_the_asked_range_across_block_edges(
    tmp_path: os.PathLike,
) -> None:
    a = direct.ALIGN
    storage, data = _file_of(tmp_path, 5 * a + 123)
    buffers = direct.ReadBuffers()
    ranges = [(0, a), (1, a - 1), (a - 1, 2 * a + 1), (7, 5 * a + 123), (3 * a, 5 * a + 123)]
    for start, end in ranges:
        got = storage.read("data.chunks", start, end, buffers=buffers)
        assert bytes(got) == data[start:end], (start, end)


def test_a_direct_read_past_the_end_of_the_file_is_a_truncation_error(
    tmp_path: os.PathLike,
) -> None:
    storage, data = _file_of(tmp_path, 2 * direct.ALIGN + 5)
    with pytest.raises(StorageError, match="truncated"):
        storage.read("data.chunks", 10, len(data) + 1, buffers=direct.ReadBuffers())


def test_a_refused_direct_read_falls_back_to_a_plain_read(
    tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Offsets that are not a multiple of any device block size: the kernel answers EINVAL
    # to the direct read, as a filesystem without O_DIRECT support would.
    monkeypatch.setattr(direct, "ALIGN", direct.ALIGN + 100)
    storage, data = _file_of(tmp_path, 3 * direct.ALIGN + 7)
    path = os.path.join(tmp_path, "data.chunks")
    try:
        got = storage.read("data.chunks", 5, len(data) - 3, buffers=direct.ReadBuffers())
        assert bytes(got) == data[5:-3]
        assert direct._device(path) in direct._refused
    finally:
        direct._refused.discard(direct._device(path))


def test_read_buffers_are_reused_only_once_nothing_refers_to_them() -> None:
    buffers = direct.ReadBuffers()
    first = buffers.take(1 << 20)
    assert direct.buffer_address(first) % direct.ALIGN == 0
    first[:] = b"\x00" * len(first)
    held = torch.frombuffer(first[64:192], dtype=torch.float32).view(4, 8)  # a decoded tensor
    del first
    second = buffers.take(1 << 20)
    assert buffers.allocated == 2  # the first is still held by the tensor over it
    second[:] = b"\xff" * len(second)
    assert torch.equal(held, torch.zeros(4, 8))  # and was not handed out again
    del held, second
    for _ in range(3):
        again = buffers.take(1 << 19)  # either buffer fits; none is allocated
        del again
    assert buffers.allocated == 2
