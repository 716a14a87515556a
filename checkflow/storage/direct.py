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
A part whose memory lines up with its file position modulo ``ALIGN`` is written from its
own memory (``checkflow.write.datafiles`` pads its layout so that snapshot buffers do); the
rest is copied into a page-aligned bounce buffer and written in ``BLOCK_BYTES`` pieces. The
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

import numpy as np

from checkflow.types import Buffer

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of addresses, offsets and lengths for O_DIRECT (any common block size divides it)."""
BLOCK_BYTES = 8 << 20
"""Bytes per write from the bounce buffer (smaller ones measured slower: more syscalls)."""
DIRECT_MIN_BYTES = 256 << 10
"""Parts at least this large are written from their own memory when it lines up."""

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
        out = _DirectWriter(fd)
        for part in parts:
            out.write(part)
        out.finish()
    finally:
        os.close(fd)


class _DirectWriter:
    """Sequential O_DIRECT writes of one file through a bounce buffer, or straight from a
    part where the part's memory and the file position line up on ``ALIGN``.

    The bounce buffer is written out only when it holds a multiple of ``ALIGN`` bytes, so
    the file position of its first byte is always aligned. A part whose address is
    congruent to its file position (``DataFileWriter`` pads the layout so that snapshot
    buffers are) has its aligned middle written from its own memory: no copy at all.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.view = memoryview(_bounce_buffer())
        self.filled = 0

    def write(self, part: memoryview) -> None:
        pos, size = 0, part.nbytes
        if size >= DIRECT_MIN_BYTES:
            head = -_address(part) % ALIGN  # bytes before the part's memory is aligned
            body = (size - head) // ALIGN * ALIGN
            if body and (self.filled + head) % ALIGN == 0:
                self._copy(part[:head])
                self._flush()
                _write_all(self.fd, part[head : head + body])
                pos = head + body
        self._copy(part[pos:])

    def finish(self) -> None:
        aligned = self.filled - self.filled % ALIGN
        if aligned:
            _write_all(self.fd, self.view[:aligned])
        if self.filled > aligned:
            # The tail does not fill an aligned block: write it through the page cache.
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            _write_all(self.fd, self.view[aligned : self.filled])
        self.filled = 0
        self.view.release()

    def _copy(self, data: memoryview) -> None:
        pos, size = 0, data.nbytes
        while pos < size:
            n = min(size - pos, BLOCK_BYTES - self.filled)
            self.view[self.filled : self.filled + n] = data[pos : pos + n]
            self.filled += n
            pos += n
            if self.filled == BLOCK_BYTES:
                self._flush()

    def _flush(self) -> None:
        if self.filled:
            _write_all(self.fd, self.view[: self.filled])
            self.filled = 0


def buffer_address(data: Buffer) -> int:
    """The memory address of a contiguous buffer's first byte."""
    return _address(memoryview(data).cast("B"))


def _address(part: memoryview) -> int:
    if part.nbytes == 0:
        return 0
    return int(np.frombuffer(part, dtype=np.uint8).ctypes.data)


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
