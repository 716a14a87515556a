"""Ranges of local files read through ``mmap`` instead of copied into a new buffer.

A restore reads each chunk once, checks its checksum and hands it to the decoder, whose
output ``load_state_dict`` copies into the live tensors. Read into a fresh ``bytearray``,
every byte is first zero-filled, then copied from the page cache, then copied again by
``load_state_dict``; mapped, the chunk is the page cache's own pages (an ``exact`` tensor
decodes to a view of them) and ``load_state_dict``'s copy is the only one.

The mapping is private (copy-on-write): a tensor over it is writable, and writing it never
changes the file. A file deleted while mapped (retention) keeps its pages until the last
view is gone. Checkpoint files are written whole and renamed into place, never truncated,
so a mapped range cannot shrink under a reader.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import Any, BinaryIO

MADV_POPULATE_READ = 22
"""Linux >= 5.14: map a range's pages for reading in one call (no copy-on-write break)."""


def map_range(f: BinaryIO, start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of the open file ``f`` (``start < end``, within its size), as
    a writable private mapping of the pages that hold them."""
    offset = start - start % mmap.ALLOCATIONGRANULARITY
    # Not MAP_POPULATE, which on a writable private mapping copies every page up front.
    mapped = mmap.mmap(f.fileno(), end - offset, access=mmap.ACCESS_COPY, offset=offset)
    # Map every page now instead of one fault per 4 KiB page on first touch; where the
    # kernel lacks MADV_POPULATE_READ, the pages fault in as they are read.
    populate(mapped)
    return memoryview(mapped)[start - offset :]


_libc: Any = None


def populate(mapped: mmap.mmap) -> None:
    """``MADV_POPULATE_READ`` over all of ``mapped``, without holding the GIL.

    ``mmap.madvise`` holds the GIL while the kernel reads the pages in, so a cold chunk's
    disk read (tens of ms) stopped every other Python thread: the reader's second thread
    could not start its own read, nor the main thread take a decoded chunk. Called through
    ctypes, which releases the GIL, reads overlap (``benchmarks/cold_read.py``). Advisory:
    failures are ignored.
    """
    global _libc
    try:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc = libc
        anchor = ctypes.c_char.from_buffer(mapped)  # the mapping's address, briefly exported
        address = ctypes.addressof(anchor)
        del anchor
    except (OSError, AttributeError, TypeError, ValueError):
        with contextlib.suppress(OSError):
            mapped.madvise(MADV_POPULATE_READ)
        return
    _libc.madvise(address, len(mapped), MADV_POPULATE_READ)
