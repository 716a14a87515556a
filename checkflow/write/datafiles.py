"""How one rank's encoded chunks are laid out in storage: boxes, data files, checksums.

A tensor is cut along dim 0 into boxes of at most ``CHUNK_BYTES`` (small boxes read faster
when resharding); encoded boxes are packed into ``rank-RRRRR-III.chunks`` files of about
``FILE_BYTES``, each box with an xxh3 checksum that a reader verifies before decoding.
"""

from __future__ import annotations

import math

import xxhash

from checkflow import manifest as mf
from checkflow.storage import Storage
from checkflow.types import Buffer

CHUNK_BYTES = 64 << 20
"""Largest encoded box of a tensor (smaller boxes read faster when resharding)."""
FILE_BYTES = 64 << 20
"""A data file is closed and written once it holds this much."""


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
    """Packs encoded chunks into ``rank-RRRRR-III.chunks`` files of about ``FILE_BYTES``."""

    def __init__(self, storage: Storage, folder: str, rank: int) -> None:
        self.storage = storage
        self.folder = folder
        self.rank = rank
        self.index = 0
        self.parts: list[Buffer] = []
        self.size = 0
        self.total = 0

    @property
    def name(self) -> str:
        return mf.rank_chunks_name(self.rank, self.index)

    def add(self, data: list[Buffer]) -> tuple[str, int]:
        nbytes = sum(memoryview(d).nbytes for d in data)
        if self.size and self.size + nbytes > FILE_BYTES:
            self.flush()
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
        self.total += self.storage.put(f"{self.folder}/{self.name}", self.parts)
        self.parts = []
        self.size = 0
        self.index += 1
