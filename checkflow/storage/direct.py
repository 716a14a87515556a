"""Write a local file without the page cache (``O_DIRECT``), falling back to plain writes.

Why: a buffered ``write`` copies every byte into freshly allocated page-cache pages, which
the kernel then writes back and later frees when retention deletes the file. On a CPU
training box that copy was most of what a checkpoint cost in CPU (about 1.5 s per GiB on
the 2-core benchmark machine, against 0.1 s for the xxh3 checksum), and the pages it fills
evict what training reads (datasets, code). With ``O_DIRECT`` the device reads the bytes
from our buffer: a checkpoint costs one copy into a small aligned bounce buffer.

The price: a checkpoint just written is not in the page cache, so restoring it on the same
machine reads the disk. Set ``CHECKFLOW_DIRECT_IO=0`` to write through the page cache.

``O_DIRECT`` needs the memory address, the file offset and the length of each write to be
multiples of the device's block size; ``ALIGN`` (4 KiB) covers 512-byte and 4 KiB devices.
Parts are copied into a page-aligned bounce buffer and written in ``BLOCK_BYTES`` pieces; the
last bytes that do not fill an aligned block are written with ``O_DIRECT`` turned off.
Filesystems that refuse ``O_DIRECT`` (tmpfs, some FUSE mounts) get plain writes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of addresses, offsets and lengths for O_DIRECT (any common block size divides it)."""
BLOCK_BYTES = 8 << 20
"""Bytes per direct write: large enough that syscalls cost nothing, small enough to stay in
the CPU caches while copied into the bounce buffer."""

_local = threading.local()
_refused: set[int] = set()
"""Devices (``st_dev``) whose filesystem refused O_DIRECT: they get plain writes."""


def direct_io_supported() -> bool:
    """True where the OS has ``O_DIRECT`` (Linux)."""
    return hasattr(os, "O_DIRECT")


def write_parts(path: str, parts: Sequence[memoryview], *, direct: bool = True) -> None:
    """Create ``path`` holding ``parts`` back to back (flat byte views), bypassing the page
    cache when ``direct`` and the filesystem allows it. The caller fsyncs and renames.

    Raises:
        OSError: the write failed (other than O_DIRECT being refused).
    """
    if direct and direct_io_supported() and _device(path) not in _refused:
        try:
            _write_direct(path, parts)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # EINVAL: this filesystem (or its block size) does not take our direct writes.
            _refused.add(_device(path))
            log.info("%s refuses O_DIRECT (%s): checkpoints there use buffered writes", path, e)
    _write_buffered(path, parts)


def _write_buffered(path: str, parts: Sequence[memoryview]) -> None:
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)


def _write_direct(path: str, parts: Sequence[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        bounce = _bounce_buffer()
        view = memoryview(bounce)
        filled = 0
        for part in parts:
            pos, size = 0, part.nbytes
            while pos < size:
                n = min(size - pos, BLOCK_BYTES - filled)
                view[filled : filled + n] = part[pos : pos + n]
                filled += n
                pos += n
                if filled == BLOCK_BYTES:
                    _write_all(fd, view[:filled])
                    filled = 0
        aligned = filled - filled % ALIGN
        if aligned:
            _write_all(fd, view[:aligned])
        if filled > aligned:
            # The tail does not fill a block: write it through the page cache.
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            _write_all(fd, view[aligned:filled])
        view.release()
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        written = os.write(fd, data)
        data = data[written:]


def _bounce_buffer() -> mmap.mmap:
    """A page-aligned buffer of ``BLOCK_BYTES`` per thread (anonymous mmap), reused."""
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = mmap.mmap(-1, BLOCK_BYTES)
    return buf


def _device(path: str) -> int:
    try:
        return os.stat(os.path.dirname(path) or ".").st_dev
    except OSError:
        return -1
