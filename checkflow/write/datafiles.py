"""How one rank's encoded chunks are laid out in storage: boxes, data files, checksums.

A tensor is cut along dim 0 into boxes of at most ``CHUNK_BYTES`` (small boxes read faster
when resharding); encoded boxes are packed into ``rank-RRRRR-III.chunks`` files of about
``FILE_BYTES``, each box with an xxh3 checksum that a reader verifies before decoding.
"""

from __future__ import annotations

import math

import xxhash

from checkflow import knobs
from checkflow import manifest as mf
from checkflow.storage import Storage, direct
from checkflow.types import Buffer

CHUNK_BYTES = 64 << 20
"""Largest encoded box of a tensor (smaller boxes read faster when resharding)."""
FILE_BYTES = 64 << 20
"""A data file is closed and written once it holds this much."""
_ZEROS = memoryview(bytes(direct.ALIGN))


def checksum(parts: list[Buffer]) -> str:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def chunk_boxes(
    shape: tuple[int, ...], itemsize: int, limit: int = CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Split along dim 0 into ``[start, stop)`` row ranges of at most ``limit`` bytes each.

    A single row larger than ``limit`` stays whole: rows are the unit a reader slices.
    """
    if not shape:
        return [(0, 1)]
    rows = shape[0]
    row_bytes = itemsize * math.prod(shape[1:])
    if rows == 0 or row_bytes * rows <= limit:
        return [(0, rows)]
    per = max(1, limit // max(1, row_bytes))
    return [(s, min(rows, s + per)) for s in range(0, rows, per)]


class DataFileWriter:
    """Packs encoded chunks into ``rank-RRRRR-III.chunks`` files of about ``FILE_BYTES``.

    On local storage written with ``O_DIRECT`` (``checkflow.storage.direct``), a large
    chunk starts at a file offset congruent to its buffer's address modulo the direct-I/O
    alignment, padded with up to 4 KiB of zeros: the writer then sends the snapshot buffer
    to the device as it is instead of copying it. Readers go by each chunk's offset, so the
    padding is invisible to them; ``total`` counts the chunks' bytes, not the padding.
    """

    def __init__(self, storage: Storage, folder: str, rank: int) -> None:
        self.storage = storage
        self.folder = folder
        self.rank = rank
        self.index = 0
        self.parts: list[Buffer] = []
        self.size = 0
        self.total = 0
        self.padding = 0
        """Zero bytes inserted in the current file to line chunks up for direct writes."""
        self.align = storage.local and knobs.direct_io() and direct.direct_io_supported()

    @property
    def name(self) -> str:
        return mf.rank_chunks_name(self.rank, self.index)

    def add(self, data: list[Buffer]) -> tuple[str, int]:
        nbytes = sum(memoryview(d).nbytes for d in data)
        if self.size and self.size + nbytes > FILE_BYTES:
            self.flush()
        self._line_up(data)
        offset = self.size
        self.parts.extend(data)
        self.size += nbytes
        return self.name, offset

    def add_object(self, fqn: str, payload: bytes) -> mf.ObjectEntry:
        file, offset = self.add([payload])
        return mf.ObjectEntry(
            fqn=fqn,
            file=file,
            byte_offset=offset,
            nbytes=len(payload),
            checksum=checksum([payload]),
            encoding=mf.OBJECTS_TREE,
        )

    def flush(self) -> None:
        if not self.parts:
            return
        written = self.storage.put(f"{self.folder}/{self.name}", self.parts)
        self.total += written - self.padding
        self.parts = []
        self.size = 0
        self.padding = 0
        self.index += 1

    def _line_up(self, data: list[Buffer]) -> None:
        """Pad so that ``data[0]`` lands at an offset congruent to its address (see above)."""
        if not self.align or not data or memoryview(data[0]).nbytes < direct.DIRECT_MIN_BYTES:
            return
        pad = (direct.buffer_address(data[0]) - self.size) % direct.ALIGN
        if pad:
            self.parts.append(_ZEROS[:pad])
            self.size += pad
            self.padding += pad
