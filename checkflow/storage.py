"""The only module that talks to fsspec: put / get ranges / list / delete, atomic writes, retries.

It knows paths and bytes, never tensors. Every write is whole-object and atomic:

- local disk: write a temporary file, fsync it, rename it over the target, fsync the folder;
- object stores: one PUT of the whole object (a reader sees all of it or none of it).

Transient errors (a dropped connection, a 5xx from S3) are retried with exponential backoff.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from checkflow.codec.base import Buffer

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 0.1
_NOT_RETRYABLE = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class StorageError(OSError):
    """A storage URI is wrong, or an operation failed after all retries."""


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
        except (ValueError, ImportError) as e:
            raise StorageError(f"cannot open checkpoint URI {uri!r}: {e}") from e
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # -- paths ---------------------------------------------------------------------------
    def path(self, relpath: str = "") -> str:
        return posixpath.join(self.root, relpath) if relpath else self.root

    def url(self, relpath: str = "") -> str:
        """A human-readable location for messages."""
        return posixpath.join(self.uri.rstrip("/"), relpath) if relpath else self.uri

    # -- writes --------------------------------------------------------------------------
    def put(self, relpath: str, parts: Sequence[Buffer]) -> int:
        """Write ``parts`` back to back as one object, atomically. Returns bytes written."""
        nbytes = sum(memoryview(p).nbytes for p in parts)
        self._retry(f"write {self.url(relpath)}", lambda: self._put_once(relpath, parts))
        return nbytes

    def _put_once(self, relpath: str, parts: Sequence[Buffer]) -> None:
        target = self.path(relpath)
        if not self.local:
            # One PUT: object stores make a whole object visible at once.
            self.fs.pipe_file(target, b"".join(parts))
            return
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            _remove_quietly(tmp)
            raise
        _fsync_dir(folder)

    # -- reads ---------------------------------------------------------------------------
    def read(self, relpath: str, start: int = 0, end: int | None = None) -> bytearray:
        """Bytes ``[start, end)`` of an object (to its end when ``end`` is None)."""
        return self._retry(
            f"read {self.url(relpath)}", lambda: self._read_once(relpath, start, end)
        )

    def _read_once(self, relpath: str, start: int, end: int | None) -> bytearray:
        target = self.path(relpath)
        if self.local:
            with open(target, "rb") as f:
                if end is None:
                    end = os.fstat(f.fileno()).st_size
                buf = bytearray(max(0, end - start))
                f.seek(start)
                got = f.readinto(buf)
            if got != len(buf):
                raise StorageError(
                    f"{self.url(relpath)} is truncated: wanted bytes {start}..{end}, "
                    f"the file ends at {start + got}"
                )
            return buf
        data = self.fs.cat_file(target, start=start, end=end)
        if end is not None and len(data) != end - start:
            raise StorageError(
                f"{self.url(relpath)} is truncated: wanted bytes {start}..{end}, "
                f"got {len(data)} bytes"
            )
        return bytearray(data)

    def exists(self, relpath: str = "") -> bool:
        return bool(
            self._retry(f"stat {self.url(relpath)}", lambda: self.fs.exists(self.path(relpath)))
        )

    def size(self, relpath: str) -> int:
        return int(
            self._retry(f"stat {self.url(relpath)}", lambda: self.fs.size(self.path(relpath)))
        )

    def listdir(self, relpath: str = "") -> list[str]:
        """Names (not paths) directly under ``relpath``; empty when it does not exist."""

        def once() -> list[str]:
            target = self.path(relpath)
            try:
                if not self.local:
                    self.fs.invalidate_cache(target)
                entries = self.fs.ls(target, detail=False)
            except FileNotFoundError:
                return []
            names = [posixpath.basename(str(e).rstrip("/")) for e in entries]
            return sorted(n for n in names if n and posixpath.join(target, n) != target)

        return self._retry(f"list {self.url(relpath)}", once)

    # -- deletes -------------------------------------------------------------------------
    def delete(self, relpath: str) -> None:
        """Delete a file or a folder with everything under it; missing is not an error."""
        if not relpath:
            raise ValueError("refusing to delete the checkpoint root")

        def once() -> None:
            target = self.path(relpath)
            try:
                self.fs.rm(target, recursive=True)
            except FileNotFoundError:
                return

        self._retry(f"delete {self.url(relpath)}", once)

    # -- retries -------------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except _NOT_RETRYABLE:
                raise
            except StorageError:
                raise
            except Exception as e:
                if attempt == self.retries:
                    raise StorageError(f"{what} failed after {attempt} attempts: {e}") from e
                log.warning(
                    "%s failed (attempt %d/%d): %s; retrying", what, attempt, self.retries, e
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")


def _fsync_dir(folder: str) -> None:
    # The rename is durable only once the folder entry is; not every OS lets us open one.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
