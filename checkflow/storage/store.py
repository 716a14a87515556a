"""The :class:`Storage` class: put / get ranges / list / delete under one checkpoint root.

It knows paths and bytes, never tensors. Every write is whole-object and atomic:

- local disk: write a temporary file, fsync it, rename it over the target, fsync the folder
  (:mod:`checkflow.storage.atomic`);
- object stores: one PUT of the whole object (a reader sees all of it or none of it).

Every operation goes through :func:`~checkflow.storage.retry.call_with_retries`, which retries
transient errors and fails at once on the rest (:mod:`checkflow.storage.errors`).
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from checkflow import knobs
from checkflow.storage.atomic import write_file_atomic
from checkflow.storage.deletes import TreeDeleter
from checkflow.storage.direct import ReadBuffers, read_range, write_parts
from checkflow.storage.errors import (
    Failure,
    StorageAccessError,
    StorageError,
    access_message,
    classify_error,
)
from checkflow.storage.local import check_inside, delete_tree, entry_kind, open_regular
from checkflow.storage.mapped import map_range
from checkflow.storage.retry import call_with_retries
from checkflow.types import Buffer

log = logging.getLogger("checkflow.storage")
T = TypeVar("T")

DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 0.1
MAP_MIN_BYTES = 1 << 20
"""Local ranges this long or longer are mapped, not copied (:mod:`checkflow.storage.mapped`):
chunks. Manifests and small objects are read into a ``bytearray`` as before."""


class Storage:
    """A checkpoint root (``uri``) on any fsspec filesystem.

    Args:
        uri: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``, ``gs://``…
        retries: attempts for each operation before giving up.
        storage_options: passed to the fsspec filesystem (e.g. ``endpoint_url`` for S3
            through ``{"client_kwargs": {"endpoint_url": ...}}``).

    Raises:
        StorageError: the URI's protocol is unknown or its filesystem cannot be created.
    """

    def __init__(
        self,
        uri: str,
        *,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise StorageError("checkpoint URI is empty; pass a local path or an fsspec URL")
        if retries < 1:
            raise ValueError("retries must be >= 1")
        self.uri = uri
        self.retries = retries
        self.backoff_s = backoff_s
        try:
            self.fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        except (ValueError, ImportError, TypeError) as e:
            # ValueError: unknown protocol; ImportError: its package (gcsfs, adlfs…) is
            # missing; TypeError: storage_options the filesystem does not take.
            raise StorageError(f"cannot open checkpoint URI {uri!r}: {e}") from e
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"
        self.map_min_bytes = MAP_MIN_BYTES
        """Local ranged reads at least this long return ``mmap`` views, not copies; whole-file
        reads (manifests, JSON) always return a ``bytearray``."""
        self.reads = 0
        """Calls that read from the root (``read``, ``listdir``): how a test proves that a
        restore from the RAM tier did not touch storage."""
        self._deleter = TreeDeleter(self.fs, name=uri)

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # -- paths ---------------------------------------------------------------------------
    def path(self, relpath: str = "") -> str:
        """The filesystem path of ``relpath`` under the root (the root itself for ``""``).

        Raises:
            ValueError: ``relpath`` is absolute or climbs out of the root with ``..``; such
                names can only come from a corrupt or hostile manifest.
        """
        if not relpath:
            return self.root
        norm = posixpath.normpath(relpath)
        if relpath.startswith("/") or norm == ".." or norm.startswith("../"):
            raise ValueError(f"{relpath!r} is not a path inside the checkpoint root {self.uri}")
        return self.root if norm == "." else posixpath.join(self.root, norm)

    def url(self, relpath: str = "") -> str:
        """A human-readable location for messages."""
        return posixpath.join(self.uri.rstrip("/"), relpath) if relpath else self.uri

    # -- writes --------------------------------------------------------------------------
    def put(self, relpath: str, parts: Sequence[Buffer]) -> int:
        """Write ``parts`` back to back as one object, atomically, replacing any old one.

        A reader sees either the old object or the whole new one, never a mix or a prefix.

        Args:
            relpath: the object's path under the root; missing folders are created.
            parts: contiguous buffers (bytes, bytearray, memoryview of an array/tensor).

        Returns:
            The number of bytes written.

        Raises:
            ValueError: a part is not a contiguous buffer (checked before any I/O).
            StorageError: the write failed after ``retries`` attempts.
        """
        views = [_byte_view(p, i) for i, p in enumerate(parts)]
        target = self.path(relpath)
        self._retry(f"write {self.url(relpath)}", lambda: self._put_once(target, views))
        return sum(v.nbytes for v in views)

    def _put_once(self, target: str, parts: Sequence[memoryview]) -> None:
        if not self.local:
            # One PUT: object stores make a whole object visible at once.
            self.fs.pipe_file(target, b"".join(parts))
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # A step folder planted as a link to another run must not be written through.
        check_inside(self.root, os.path.dirname(target))

        def write(tmp: str) -> None:
            write_parts(tmp, parts, direct=knobs.direct_io())

        write_file_atomic(target, write)

    # -- reads ---------------------------------------------------------------------------
    def read(
        self,
        relpath: str,
        start: int = 0,
        end: int | None = None,
        *,
        buffers: ReadBuffers | None = None,
    ) -> bytearray:
        """Bytes ``[start, end)`` of an object (to its end when ``end`` is None).

        A local chunk-sized range is mapped from the page cache; given ``buffers`` it is read
        past the page cache into one of them instead (:func:`~checkflow.storage.direct.
        read_range`): for bytes that only pass through the host on their way to a device.

        Raises:
            FileNotFoundError: the object does not exist.
            StorageError: the object ends before ``end`` (or before ``start``), or the read
                failed after ``retries`` attempts.
        """
        if start < 0 or (end is not None and end < start):
            raise ValueError(f"bad byte range {start}..{end} for {self.url(relpath)}")
        self.path(relpath)  # reject a bad name now, not after retries
        self.reads += 1
        return self._retry(
            f"read {self.url(relpath)}", lambda: self._read_once(relpath, start, end, buffers)
        )

    def read_at_most(self, relpath: str, limit: int) -> bytearray:
        """The whole object, or its first ``limit + 1`` bytes when it is longer: a caller
        that refuses objects over ``limit`` (a manifest) never holds more than that, however
        large the object claims to be (a sparse file of 512 MiB costs nothing here).

        Raises:
            FileNotFoundError: the object does not exist.
            StorageError: the read failed after ``retries`` attempts.
        """
        self.path(relpath)
        self.reads += 1

        def once() -> bytearray:
            with self._open_for_read(relpath) as f:
                return bytearray(f.read(limit + 1))

        return self._retry(f"read {self.url(relpath)}", once)

    def _read_once(
        self, relpath: str, start: int, end: int | None, buffers: ReadBuffers | None
    ) -> bytearray:
        target = self.path(relpath)
        if self.local:
            with open_regular(self.root, target) as f:
                size = os.fstat(f.fileno()).st_size
                ranged, end = end is not None, size if end is None else end
                if start > size or end > size:
                    raise self._truncated(relpath, start, end, size)
                if ranged and end - start >= self.map_min_bytes:  # a chunk, not a manifest
                    if buffers is not None:
                        return read_range(f, start, end, buffers)  # type: ignore[return-value]
                    return map_range(f, start, end)  # type: ignore[return-value]
                buf = bytearray(end - start)
                f.seek(start)
                got = f.readinto(buf)
            if got != len(buf):  # shrunk between fstat and read: someone broke atomicity
                raise self._truncated(relpath, start, end, start + got)
            return buf
        if end == start:
            # S3 answers an empty range with 416; there is nothing to fetch anyway.
            return bytearray()
        try:
            data = self.fs.cat_file(target, start=start, end=end)
        except OSError as e:
            # s3fs turns S3's 416 "range not satisfiable" into EINVAL: the object is shorter
            # than asked. That is a fact about the object, not a transient error to retry.
            if e.errno != errno.EINVAL:
                raise
            size = int(self.fs.size(target))
            if end is None and start == size:
                return bytearray()
            raise self._truncated(relpath, start, end, size) from e
        if end is None and not data and start > 0:
            # memory:// returns b"" for a start past the end; tell that from start == size.
            size = int(self.fs.size(target))
            if start > size:
                raise self._truncated(relpath, start, end, size)
        if end is not None and len(data) != end - start:
            # Past the end, memory:// gives b"" whatever the size: ask for the real size.
            size = start + len(data) if data else int(self.fs.size(target))
            raise self._truncated(relpath, start, end, size)
        return bytearray(data)

    def _truncated(self, relpath: str, start: int, end: int | None, size: int) -> StorageError:
        want = f"{start}..{end}" if end is not None else f"{start}..end"
        return StorageError(
            f"{self.url(relpath)} is truncated: wanted bytes {want}, it ends at byte {size}"
        )

    def exists(self, relpath: str = "") -> bool:
        """Whether an object or a folder exists at ``relpath``."""

        self.path(relpath)

        def once() -> bool:
            target = self._uncached(relpath)
            if self.local:
                return bool(self.fs.exists(target))
            # Not fs.exists: s3fs and fsspec's default answer False for *any* error, so
            # missing credentials or a missing bucket would read as "no such checkpoint".
            try:
                self.fs.info(target)
            except FileNotFoundError as e:
                if classify_error(e) is Failure.NOT_FOUND:
                    return False
                raise
            return True

        return self._retry(f"stat {self.url(relpath)}", once)

    def entry_kind(self, relpath: str) -> str | None:
        """What a local entry is, not following a link ("file", "folder", "symbolic
        link", "FIFO"…; None when missing); None on object stores, which hold only objects
        and prefixes."""
        target = self.path(relpath)
        return entry_kind(target) if self.local else None

    def size(self, relpath: str) -> int:
        """The size in bytes of the object at ``relpath``.

        Raises:
            FileNotFoundError: the object does not exist.
        """
        self.path(relpath)

        def once() -> int:
            if self.local:  # of the file a reader would open, never of a link's target
                with open_regular(self.root, self.path(relpath)) as f:
                    return os.fstat(f.fileno()).st_size
            return int(self.fs.size(self._uncached(relpath)))

        return self._retry(f"stat {self.url(relpath)}", once)

    def _open_for_read(self, relpath: str) -> Any:
        if self.local:
            return open_regular(self.root, self.path(relpath))
        return self.fs.open(self._uncached(relpath), "rb")

    def listdir(self, relpath: str = "") -> list[str]:
        """Names (not paths) directly under ``relpath``, sorted; empty when it does not exist."""
        self.path(relpath)
        self.reads += 1

        def once() -> list[str]:
            target = self._uncached(relpath)
            try:
                entries = self.fs.ls(target, detail=False)
            except FileNotFoundError as e:
                if classify_error(e) is Failure.NOT_FOUND:
                    return []
                raise  # no such bucket: not an empty folder
            names = [posixpath.basename(str(e).rstrip("/")) for e in entries]
            return sorted(n for n in names if n and posixpath.join(target, n) != target)

        return self._retry(f"list {self.url(relpath)}", once)

    # -- deletes -------------------------------------------------------------------------
    def delete(self, relpath: str) -> None:
        """Delete a file or a folder with everything under it; missing is not an error.

        Raises:
            ValueError: ``relpath`` names the root itself (``""``, ``"."``) or lies outside it.
            StorageError: the delete failed after ``retries`` attempts.
            StorageAccessError: the store refuses it, or answered yet kept objects.
        """
        target = self.path(relpath)
        if target == self.root:
            raise ValueError(f"refusing to delete the checkpoint root {self.uri}")

        def once() -> None:
            if self.local:  # never through a link, never outside the root
                delete_tree(self.root, target)
                return
            left = self._deleter.delete(target)
            if left:
                raise StorageAccessError(self._kept_message(relpath, left), Failure.DENIED)

        self._retry(f"delete {self.url(relpath)}", once)

    def _kept_message(self, relpath: str, left: list[str]) -> str:
        return (
            f"delete {self.url(relpath)} failed: the store answered but kept {len(left)} "
            f"object(s) ({left[0]}…): a read-only endpoint, or credentials without delete "
            f"rights; use an endpoint and credentials that may delete under {self.uri}"
        )

    def _uncached(self, relpath: str) -> str:
        # s3fs answers exists/size/ls from a listing cache filled by earlier calls; other
        # ranks and processes write to the same prefix, so always ask the store.
        target = self.path(relpath)
        if not self.local:
            self.fs.invalidate_cache(target)
        return target

    # -- retries -------------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return call_with_retries(
            what,
            fn,
            retries=self.retries,
            backoff_s=self.backoff_s,
            describe_access=self._access_message,
        )

    def _access_message(self, what: str, failure: Failure, error: BaseException) -> str:
        return access_message(what, failure, error, uri=self.uri, root=self.root, fs=self.fs)


def _byte_view(part: Buffer, index: int) -> memoryview:
    # A flat byte view lets file.write and bytes.join take any dtype/shape, and rejects a
    # non-contiguous array here, once, instead of failing (and retrying) mid-write.
    try:
        return memoryview(part).cast("B")
    except TypeError as e:
        raise ValueError(f"part {index} is not a contiguous buffer: {e}") from e
