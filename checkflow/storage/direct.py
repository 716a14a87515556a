"""Write (and read) local files without the page cache (``O_DIRECT``), falling back to
plain I/O where the filesystem refuses it.

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

``read_range`` is the read side, for a restore whose bytes only pass through the host on
their way to a device (``checkflow.read``): read into memory of the process's own heap,
they leave no page-cache pages behind to allocate, map and later reclaim.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import BinaryIO

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


class ReadBuffers:
    """Page-aligned buffers that ``read_range`` reads into, each reused once nothing refers
    to it any more (a tensor decoded from it, a transfer to a device still running).

    A restore that sends each tensor to its device as soon as it is read then needs a few
    chunks of host memory in all, touched once. Whether a buffer is still in use is read
    from its reference count: every view of it (memoryview, numpy, ``torch.frombuffer``)
    holds one, however it was derived.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.allocated = 0
        """Buffers allocated so far (reused ones are not counted again)."""
        # What ``_counts`` says of a buffer that only this object holds (the interpreter's
        # own references differ between Python versions, so it is measured, not assumed).
        self._held: list[np.ndarray] = [np.empty(1, dtype=np.uint8)]
        self._unused_count = self._counts()[0]
        self._held = []

    def _counts(self) -> list[int]:
        return [sys.getrefcount(raw) for raw in self._held]

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of page-aligned memory, writable, for the caller alone."""
        with self._lock:
            free = [
                raw
                for raw, count in zip(self._held, self._counts(), strict=True)
                if count <= self._unused_count and raw.nbytes >= nbytes + ALIGN
            ]
            if free:
                raw = min(free, key=lambda b: b.nbytes)  # the smallest that fits
            else:
                raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
                self._held.append(raw)
                self.allocated += 1
            skip = -int(raw.ctypes.data) % ALIGN
            return memoryview(raw)[skip : skip + nbytes]  # type: ignore[arg-type]


def read_range(f: BinaryIO, start: int, end: int, buffers: ReadBuffers) -> memoryview:
    """Bytes ``[start, end)`` of the open file ``f`` (within its size), read with
    ``O_DIRECT`` into one of ``buffers`` (plain reads where the filesystem refuses it).

    The read covers the aligned blocks around the range, and nothing lands in the page
    cache: no new page-cache pages to allocate, map and later reclaim, and the buffers are
    memory the process already touched (a virtual machine may make first touches of new
    pages slow: ``benchmarks/xla_restore_phases.py``).

    Raises:
        OSError: the read failed, or the file ends before ``end``.
    """
    lo, hi = start - start % ALIGN, -(-end // ALIGN) * ALIGN
    buf = buffers.take(hi - lo)
    got = 0
    if direct_io_supported() and _device(f.name) not in _refused:
        try:
            got = _read_all(f, buf, lo, os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _refused.add(_device(f.name))
            log.info("%s refuses O_DIRECT (%s): restores there read through the cache", f.name, e)
            got = 0
    if got < end - lo:
        got = _read_all(f, buf, lo, 0)
    if got < end - lo:
        raise OSError(errno.EIO, f"{f.name} ends at byte {lo + got}, before byte {end}")
    return buf[start - lo : end - lo]


def _read_all(f: BinaryIO, buf: memoryview, offset: int, flags: int) -> int:
    """Read ``buf`` from ``offset`` of the file ``f`` until it is full or the file ends.

    ``O_DIRECT`` needs a descriptor of its own, opened by name: it is opened without
    following a link or blocking, and must be the very file ``f`` is (a name swapped for a
    FIFO or a link between the two opens is refused).
    """
    fd = os.open(f.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    try:
        mine, theirs = os.fstat(fd), os.fstat(f.fileno())
        if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
            raise OSError(errno.ESTALE, f"{f.name} was replaced while it was being read")
        got = 0
        while got < buf.nbytes:
            n = os.preadv(fd, [buf[got:]], offset + got)
            if n <= 0:
                break
            got += n
            if flags and got % ALIGN:
                break  # a direct read stops short only at the end of the file
        return got
    finally:
        os.close(fd)


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
