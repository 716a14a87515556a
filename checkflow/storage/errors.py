"""Storage errors and :func:`classify_error`, the one place that tells them apart.

Transient errors (a dropped connection, a timeout, a 5xx or a throttling answer from S3) are
worth a retry. Errors that no retry can fix (no credentials, credentials the store rejects,
access denied, no such bucket) must fail at once as :class:`StorageAccessError`, with a
message that says what to do. A pure module: it imports no store client, so it is tested
without one.
"""

from __future__ import annotations

import enum
import errno
from typing import Any


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


ACCESS_FAILURES = frozenset(
    {Failure.NO_BUCKET, Failure.NO_CREDENTIALS, Failure.BAD_CREDENTIALS, Failure.DENIED}
)
"""The failures raised as :class:`StorageAccessError`: the URI as a whole is refused."""

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


def root_cause(error: BaseException) -> str:
    """The words of the OS error ``error`` was raised from (``[Errno 2] No such file or
    directory: '/proc/x'``), else ``error``'s own: the retry wrapper re-raises a missing
    folder as "write ... failed: no such file or object", which hides the path at fault."""
    seen: set[int] = set()
    found: BaseException = error
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno and current.filename:
            found = current
        current = current.__cause__ or current.__context__
    return str(found) or type(found).__name__


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


def access_message(
    what: str, failure: Failure, error: BaseException, *, uri: str, root: str, fs: Any
) -> str:
    """One line for a :class:`StorageAccessError`: what failed, why, and what to do about it.

    Args:
        what: the operation and its object ("write s3://bucket/step-…/rank-00000.chunks").
        failure: one of the access failures (no bucket, no or bad credentials, denied).
        error: the store's exception, whose own words are quoted.
        uri: the checkpoint root, named in the advice.
        root: its path on ``fs`` (``bucket/prefix`` for object stores).
        fs: its fsspec filesystem (the protocol picks the credentials hint).
    """
    detail = _error_detail(error)
    if failure is Failure.NO_BUCKET:
        bucket = root.split("/", 1)[0]
        return (
            f"{what} failed: bucket {bucket!r} does not exist; "
            "create it, or fix the bucket name in the URI"
        )
    if failure is Failure.NO_CREDENTIALS:
        return f"{what} failed: no credentials found ({detail}); {_credentials_hint(uri, fs)}"
    if failure is Failure.BAD_CREDENTIALS:
        return (
            f"{what} failed: the store rejected the credentials ({detail}); "
            f"check the access key and secret, {_credentials_hint(uri, fs)}"
        )
    return (
        f"{what} failed: access denied ({detail}); use credentials (or file permissions) "
        f"that may read, write, list and delete under {uri}"
    )


def _credentials_hint(uri: str, fs: Any) -> str:
    if "s3" in _protocols(fs):
        return (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
            "or pass the storage options key=... and secret=..."
        )
    return f"configure credentials for {uri} or pass them as storage options"


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
