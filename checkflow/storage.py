"""The only module that talks to fsspec: put / get ranges / list / delete, atomic writes, retries.

It knows paths and bytes, never tensors. Every write is whole-object and atomic:

- local disk: write a temporary file, fsync it, rename it over the target, fsync the folder;
- object stores: one PUT of the whole object (a reader sees all of it or none of it).

Transient errors (a dropped connection, a timeout, a 5xx or a throttling answer from S3) are
retried with exponential backoff. Errors that no retry can fix (no credentials, credentials the
store rejects, access denied, no such bucket) fail at once as :class:`StorageAccessError`;
:func:`classify_error` is the one place that tells them apart.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from checkflow.types import Buffer

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 0.1


class StorageError(OSError):
    """A storage URI is wrong, or an operation failed after all retries."""


class StorageAccessError(Exception):
    """The store refuses this URI as a whole: retrying, or an older checkpoint, cannot help.

    Missing credentials, credentials the store rejects, access denied, or no such bucket.
    Deliberately not an ``OSError``/``StorageError``: the read path falls back to an older
    checkpoint on those, and every older checkpoint would fail the same way; this error
    must reach the user instead, once.

    Attributes:
        failure: which of the :class:`Failure` kinds it is.
    """

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.failure = failure


class Failure(enum.Enum):
    """What a storage error means for the caller: retry, report, or pass on."""

    TRANSIENT = "transient"
    """A timeout, a dropped or refused connection, a 5xx, throttling: retry."""
    NOT_FOUND = "not found"
    """No such object or folder: a fact callers act on (``FileNotFoundError``)."""
    NO_BUCKET = "no such bucket"
    NO_CREDENTIALS = "no credentials"
    BAD_CREDENTIALS = "credentials rejected"
    DENIED = "access denied"
    PERMANENT = "permanent"
    """Anything else (a bad argument, a full disk, a bug): not retried, passed on as is."""


_ACCESS_FAILURES = frozenset(
    {Failure.NO_BUCKET, Failure.NO_CREDENTIALS, Failure.BAD_CREDENTIALS, Failure.DENIED}
)

# Exception class names, matched anywhere in the class's MRO so that botocore, aiohttp and
# google-auth need not be imported (checkflow does not depend on any of them).
_NO_CREDENTIALS_CLASSES = frozenset(
    {
        "NoCredentialsError",  # botocore: nothing in env, config, profile or IMDS
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "DefaultCredentialsError",  # google-auth (gcsfs)
    }
)
_TRANSIENT_CLASSES = frozenset(
    {
        "TimeoutError",  # also asyncio's and fsspec's FSTimeoutError
        "ConnectionError",  # builtin (resets, refusals, broken pipes) and botocore's
        "HTTPClientError",  # botocore: ReadTimeoutError, ConnectionClosedError…
        "EndpointConnectionError",
        "ResponseStreamingError",  # botocore: the body stopped half way
        "IncompleteRead",  # http.client / urllib3
        "ProtocolError",  # urllib3
        "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientOSError…
        "ClientPayloadError",
        "ServerTimeoutError",
    }
)
_NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_BAD_CREDENTIALS_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
    }
)
_DENIED_CODES = frozenset(
    {"AccessDenied", "AllAccessDisabled", "AccountProblem", "RequestTimeTooSkewed", "403"}
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestTimeout",  # S3 answers 400 for it, yet a new request usually succeeds
        "OperationAborted",  # a conflicting operation on the bucket was in progress
        "InternalError",
        "ServiceUnavailable",
    }
)
# s3fs maps 503 and SlowDown to EBUSY, 500 to EREMOTEIO, an unknown S3 code to EIO.
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EAGAIN",
        "EINTR",
        "EBUSY",
        "EIO",
        "EREMOTEIO",
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "EHOSTUNREACH",
    )
    if hasattr(errno, name)
)


def classify_error(error: BaseException) -> Failure:
    """What a storage error means: retry it (:attr:`Failure.TRANSIENT`) or not, and why not.

    A pure function of the exception (its classes, its S3 error code and HTTP status, its
    errno, its message), so it is tested without a store. s3fs turns botocore's
    ``ClientError`` into ``PermissionError`` / ``FileNotFoundError`` / ``OSError`` and keeps
    the original as ``__cause__``; the S3 code in there is more precise than the type, so it
    decides when present (``NoSuchBucket`` and ``NoSuchKey`` are both a FileNotFoundError).
    """
    client_error = _client_error_in(error)
    if client_error is not None:
        return _classify_client_error(client_error)
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _NO_CREDENTIALS_CLASSES:
        return Failure.NO_CREDENTIALS
    if isinstance(error, FileNotFoundError):
        # Without the S3 code (a HEAD answer has no body) only the message tells them apart.
        missing_bucket = "bucket does not exist" in str(error).lower()
        return Failure.NO_BUCKET if missing_bucket else Failure.NOT_FOUND
    if isinstance(error, PermissionError):
        return Failure.DENIED
    if names & _TRANSIENT_CLASSES:
        return Failure.TRANSIENT
    if _http_status(error) in (429, *range(500, 600)):
        return Failure.TRANSIENT  # e.g. gcsfs's HttpError(code=503)
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return Failure.TRANSIENT
    return Failure.PERMANENT


def _client_error_in(error: BaseException) -> BaseException | None:
    """The botocore ``ClientError`` that ``error`` is or was raised from, if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return current
        current = current.__cause__
    return None


def _classify_client_error(error: BaseException) -> Failure:
    response: dict[str, Any] = error.response  # type: ignore[attr-defined]
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in _NO_BUCKET_CODES:
        return Failure.NO_BUCKET
    if code in _BAD_CREDENTIALS_CODES:
        return Failure.BAD_CREDENTIALS
    if code in _DENIED_CODES or status == 403:
        return Failure.DENIED
    if code in _NOT_FOUND_CODES or status == 404:
        return Failure.NOT_FOUND
    if code in _TRANSIENT_CODES or status == 429 or (isinstance(status, int) and status >= 500):
        return Failure.TRANSIENT
    if code.isdigit() and (int(code) == 429 or int(code) >= 500):
        return Failure.TRANSIENT
    return Failure.PERMANENT


def _http_status(error: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        value = getattr(error, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


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

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)

        write_file_atomic(target, write)

    # -- reads ---------------------------------------------------------------------------
    def read(self, relpath: str, start: int = 0, end: int | None = None) -> bytearray:
        """Bytes ``[start, end)`` of an object (to its end when ``end`` is None).

        Raises:
            FileNotFoundError: the object does not exist.
            StorageError: the object ends before ``end`` (or before ``start``), or the read
                failed after ``retries`` attempts.
        """
        if start < 0 or (end is not None and end < start):
            raise ValueError(f"bad byte range {start}..{end} for {self.url(relpath)}")
        self.path(relpath)  # reject a bad name now, not after retries
        return self._retry(
            f"read {self.url(relpath)}", lambda: self._read_once(relpath, start, end)
        )

    def _read_once(self, relpath: str, start: int, end: int | None) -> bytearray:
        target = self.path(relpath)
        if self.local:
            with open(target, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                end = size if end is None else end
                if start > size or end > size:
                    raise self._truncated(relpath, start, end, size)
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

    def size(self, relpath: str) -> int:
        """The size in bytes of the object at ``relpath``.

        Raises:
            FileNotFoundError: the object does not exist.
        """
        self.path(relpath)
        return self._retry(
            f"stat {self.url(relpath)}", lambda: int(self.fs.size(self._uncached(relpath)))
        )

    def listdir(self, relpath: str = "") -> list[str]:
        """Names (not paths) directly under ``relpath``, sorted; empty when it does not exist."""
        self.path(relpath)

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
        """
        target = self.path(relpath)
        if target == self.root:
            raise ValueError(f"refusing to delete the checkpoint root {self.uri}")

        def once() -> None:
            try:
                self.fs.rm(target, recursive=True)
            except FileNotFoundError as e:
                if classify_error(e) is not Failure.NOT_FOUND:
                    raise

        self._retry(f"delete {self.url(relpath)}", once)

    def _uncached(self, relpath: str) -> str:
        # s3fs answers exists/size/ls from a listing cache filled by earlier calls; other
        # ranks and processes write to the same prefix, so always ask the store.
        target = self.path(relpath)
        if not self.local:
            self.fs.invalidate_cache(target)
        return target

    # -- retries -------------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with exponential backoff while it fails transiently.

        Raises:
            StorageAccessError: at once, for an error no retry can fix (see ``Failure``).
            FileNotFoundError: at once, the object or folder does not exist.
            StorageError: a transient failure outlived ``retries`` attempts.
        """
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except StorageError:
                raise  # already says what is wrong with the object (truncated…)
            except Exception as e:
                failure = classify_error(e)
                if failure in _ACCESS_FAILURES:
                    raise StorageAccessError(self._access_message(what, failure, e), failure) from e
                if failure is Failure.NOT_FOUND:
                    # s3fs says "The specified key does not exist." without naming it.
                    missing = f"{what} failed: no such file or object"
                    raise FileNotFoundError(errno.ENOENT, missing) from e
                if failure is not Failure.TRANSIENT:
                    raise
                if attempt == self.retries:
                    raise StorageError(f"{what} failed after {attempt} attempts: {e}") from e
                log.warning(
                    "%s failed (attempt %d/%d): %s; retrying", what, attempt, self.retries, e
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _access_message(self, what: str, failure: Failure, error: BaseException) -> str:
        """One line: what failed, why, and what to do about it."""
        detail = _error_detail(error)
        if failure is Failure.NO_BUCKET:
            bucket = self.root.split("/", 1)[0]
            return (
                f"{what} failed: bucket {bucket!r} does not exist; "
                "create it, or fix the bucket name in the URI"
            )
        if failure is Failure.NO_CREDENTIALS:
            return f"{what} failed: no credentials found ({detail}); {self._credentials_hint()}"
        if failure is Failure.BAD_CREDENTIALS:
            return (
                f"{what} failed: the store rejected the credentials ({detail}); "
                f"check the access key and secret, {self._credentials_hint()}"
            )
        return (
            f"{what} failed: access denied ({detail}); use credentials (or file permissions) "
            f"that may read, write, list and delete under {self.uri}"
        )

    def _credentials_hint(self) -> str:
        if "s3" in _protocols(self.fs):
            return (
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                "or pass the storage options key=... and secret=..."
            )
        return f"configure credentials for {self.uri} or pass them as storage options"


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _error_detail(error: BaseException) -> str:
    """The store's own words: ``Code: message`` from an S3 answer, else the exception text."""
    client_error = _client_error_in(error)
    if client_error is not None:
        answer = client_error.response["Error"]  # type: ignore[attr-defined]
        code, message = answer.get("Code", ""), answer.get("Message", "")
        if code and message and code != message:
            return f"{code}: {message}"
        return str(message or code)
    return str(error) or type(error).__name__


def _byte_view(part: Buffer, index: int) -> memoryview:
    # A flat byte view lets file.write and bytes.join take any dtype/shape, and rejects a
    # non-contiguous array here, once, instead of failing (and retrying) mid-write.
    try:
        return memoryview(part).cast("B")
    except TypeError as e:
        raise ValueError(f"part {index} is not a contiguous buffer: {e}") from e


def write_file_atomic(target: str, write: Callable[[str], None], *, replace: bool = True) -> None:
    """Make a local file appear whole or not at all: ``write(tmp)`` fills a temporary file
    next to ``target``, which is fsynced and moved into place, then the folder is fsynced.

    ``write`` gets a path rather than a file object because writers such as
    ``safetensors.save_file`` only take paths. A crash leaves at most a hidden
    ``.<name>.tmp-*`` file, never a partial ``target``.

    Args:
        target: the local file to create or replace; its folder must exist.
        write: fills the file at the path it is given.
        replace: replace an existing ``target``. When False an existing (or concurrently
            created) ``target`` is left untouched: a hard link is an atomic
            create-if-absent.

    Raises:
        FileExistsError: ``replace`` is False and ``target`` exists.
    """
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data is durable before any name points at it
        if replace:
            os.replace(tmp, target)
        else:
            _link_no_clobber(tmp, target)
    finally:
        _remove_quietly(tmp)  # renamed away already, or a hard link's second name
    fsync_dir(folder)


def _link_no_clobber(tmp: str, target: str) -> None:
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError:
        # Some filesystems have no hard links; fall back to check-then-rename.
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "file exists", target) from None
        os.replace(tmp, target)


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (best effort: not every OS can open a folder)."""
    # The rename is durable only once the folder entry is; not every OS lets us open one.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
