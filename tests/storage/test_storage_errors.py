"""Storage errors that retrying cannot fix fail at once; only transient ones are retried.

The first half checks :func:`classify_error` alone, on the exceptions botocore, s3fs and
aiohttp really raise (built with their own classes and s3fs's own translation). The
second half goes through a real S3 endpoint: the session's moto server for a missing
bucket and missing credentials, and a second moto server that checks signatures and IAM
policies for rejected credentials and access denied.

Every failure here is asserted to come back well inside the retry schedule that a
transient error would get (``backoff_s=2``: 2 + 4 + 5 + 5 s of sleep over 5 attempts),
with no retry warning logged and, where a request is sent at all, none sent twice.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from s3fs.errors import translate_boto_error

from checkflow.storage import Failure, Storage, StorageAccessError, StorageError, classify_error
from tests.support.moto_server import checking_moto
from tests.support.s3 import FaultyS3Proxy, s3_options

RETRIES, BACKOFF_S = 5, 2.0
RETRY_SCHEDULE_S = 2 + 4 + 5 + 5  # the sleeps a transient error would get before giving up
AT_ONCE_S = 1.0


def client_error(code: str, status: int, operation: str = "GetObject") -> ClientError:
    """What botocore raises for an S3 error answer."""
    response = {
        "Error": {"Code": code, "Message": f"message for {code}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)  # type: ignore[arg-type]


def as_s3fs_raises(code: str, status: int) -> BaseException:
    """What s3fs raises for that answer: a builtin exception caused by the ClientError."""
    return translate_boto_error(client_error(code, status))


# -- classify_error: unit tests -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "status", "failure"),
    [
        ("NoSuchBucket", 404, Failure.NO_BUCKET),
        ("NoSuchKey", 404, Failure.NOT_FOUND),
        ("404", 404, Failure.NOT_FOUND),  # a HEAD answer: no body, the status is the code
        ("InvalidAccessKeyId", 403, Failure.BAD_CREDENTIALS),
        ("SignatureDoesNotMatch", 403, Failure.BAD_CREDENTIALS),
        ("ExpiredToken", 400, Failure.BAD_CREDENTIALS),
        ("AccessDenied", 403, Failure.DENIED),
        ("403", 403, Failure.DENIED),
        ("SlowDown", 503, Failure.TRANSIENT),
        ("ServiceUnavailable", 503, Failure.TRANSIENT),
        ("InternalError", 500, Failure.TRANSIENT),
        ("RequestTimeout", 400, Failure.TRANSIENT),
        ("ThrottlingException", 400, Failure.TRANSIENT),
        ("502", 502, Failure.TRANSIENT),
        ("TooManyRequests", 429, Failure.TRANSIENT),
        ("InvalidBucketName", 400, Failure.PERMANENT),
        ("EntityTooLarge", 400, Failure.PERMANENT),
    ],
)
def test_an_s3_error_is_classified_by_its_code_raw_and_as_s3fs_translates_it(
    code: str, status: int, failure: Failure
) -> None:
    assert classify_error(client_error(code, status)) is failure
    assert classify_error(as_s3fs_raises(code, status)) is failure


def test_s3fs_maps_denied_and_missing_answers_to_permission_and_file_not_found() -> None:
    # The builtin types s3fs picks are what callers see; the S3 code behind them still decides.
    assert isinstance(as_s3fs_raises("AccessDenied", 403), PermissionError)
    assert isinstance(as_s3fs_raises("InvalidAccessKeyId", 403), PermissionError)
    assert isinstance(as_s3fs_raises("NoSuchBucket", 404), FileNotFoundError)
    assert isinstance(as_s3fs_raises("NoSuchKey", 404), FileNotFoundError)


@pytest.mark.parametrize(
    ("error", "failure"),
    [
        (NoCredentialsError(), Failure.NO_CREDENTIALS),
        (
            PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
            Failure.NO_CREDENTIALS,
        ),
        (PermissionError(errno.EACCES, "Permission denied", "/ckpt/step-1"), Failure.DENIED),
        (FileNotFoundError(errno.ENOENT, "No such file", "/ckpt/MANIFEST.json"), Failure.NOT_FOUND),
        (FileNotFoundError("The specified bucket does not exist"), Failure.NO_BUCKET),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), Failure.TRANSIENT),
        (ConnectionClosedError(endpoint_url="http://127.0.0.1:1"), Failure.TRANSIENT),
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), Failure.TRANSIENT),
        (aiohttp.ServerDisconnectedError(), Failure.TRANSIENT),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), Failure.TRANSIENT),
        (TimeoutError("read timed out"), Failure.TRANSIENT),
        (OSError(errno.EBUSY, "Please reduce your request rate"), Failure.TRANSIENT),
        (OSError(errno.ENOSPC, "No space left on device"), Failure.PERMANENT),
        (IsADirectoryError(errno.EISDIR, "Is a directory"), Failure.PERMANENT),
        (ValueError("bad storage option"), Failure.PERMANENT),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_an_error_without_an_s3_code_is_classified_by_its_type_errno_or_message(
    error: BaseException, failure: Failure
) -> None:
    assert classify_error(error) is failure


def test_an_http_status_attribute_of_5xx_or_429_is_transient() -> None:
    class HttpError(Exception):  # the shape of gcsfs's and aiohttp's response errors
        def __init__(self, code: int) -> None:
            super().__init__(f"HTTP {code}")
            self.code = code

    assert classify_error(HttpError(503)) is Failure.TRANSIENT
    assert classify_error(HttpError(429)) is Failure.TRANSIENT
    assert classify_error(HttpError(400)) is Failure.PERMANENT


# -- through a real S3 endpoint ---------------------------------------------------------------
def _retry_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "checkflow.storage" and r.levelno >= logging.WARNING
    ]


def _fails_at_once(
    storage: Storage, operation: str, caplog: pytest.LogCaptureFixture
) -> StorageAccessError:
    """Run ``operation`` on ``storage``: it must raise StorageAccessError, at once.

    The clock starts once the S3 client exists: making one parses botocore's service
    model, which can take a second on a loaded machine and is not what is measured here.
    """
    op = _operations(storage)[operation]
    storage.fs.connect()
    began = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="checkflow.storage"),
        pytest.raises(StorageAccessError) as raised,
    ):
        op()
    elapsed = time.monotonic() - began
    assert _retry_warnings(caplog) == []
    assert elapsed < AT_ONCE_S < BACKOFF_S < RETRY_SCHEDULE_S
    return raised.value


def _operations(storage: Storage) -> dict[str, Callable[[], object]]:
    return {
        "exists": lambda: storage.exists(""),
        "listdir": storage.listdir,
        "read": lambda: storage.read("step-000000010/MANIFEST.json"),
        "put": lambda: storage.put("step-000000010/rank-00000.chunks", [b"chunk"]),
    }


OPERATION_VERBS = {"exists": "stat", "listdir": "list", "read": "read", "put": "write"}


@pytest.mark.s3
@pytest.mark.parametrize("operation", list(OPERATION_VERBS))
def test_a_missing_bucket_fails_at_once_naming_it_without_a_retry(
    s3_fault_proxy: FaultyS3Proxy, caplog: pytest.LogCaptureFixture, operation: str
) -> None:
    bucket = f"checkflow-missing-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{bucket}/run"
    # Through the proxy (which fails nothing) only to see every request that was sent.
    storage = Storage(
        uri,
        storage_options=s3_options(s3_fault_proxy.endpoint),
        retries=RETRIES,
        backoff_s=BACKOFF_S,
    )

    error = _fails_at_once(storage, operation, caplog)

    assert error.failure is Failure.NO_BUCKET
    assert f"{OPERATION_VERBS[operation]} {uri}" in str(error)
    assert f"bucket {bucket!r} does not exist" in str(error)
    assert "create it" in str(error)
    sent = [(method, path) for method, path, _ in s3_fault_proxy.log]
    assert sent and len(sent) == len(set(sent))  # each request went out once: no retry


@pytest.mark.s3
def test_a_missing_object_in_an_existing_bucket_is_file_not_found_at_once(
    s3_uri: Any, caplog: pytest.LogCaptureFixture
) -> None:
    uri, options = s3_uri
    storage = Storage(uri, storage_options=options, retries=RETRIES, backoff_s=BACKOFF_S)
    storage.fs.connect()

    began = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="checkflow.storage"),
        pytest.raises(FileNotFoundError, match=rf"read {uri}/step-000000010/MANIFEST\.json"),
    ):
        storage.read("step-000000010/MANIFEST.json")

    assert time.monotonic() - began < AT_ONCE_S
    assert _retry_warnings(caplog) == []
    assert storage.exists("step-000000010") is False  # and the callers' answers stay the same
    assert storage.listdir("step-000000010") == []


_NO_AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_NO_AWS_CREDENTIALS += ("AWS_PROFILE", "AWS_DEFAULT_PROFILE")


@pytest.mark.s3
@pytest.mark.parametrize("operation", list(OPERATION_VERBS))
def test_missing_credentials_fail_at_once_and_say_how_to_give_them(
    s3_endpoint: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    operation: str,
) -> None:
    # No keys in env or options; the conftest already points the config and credentials
    # files at /dev/null and disables the EC2 metadata lookup.
    for name in _NO_AWS_CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    assert os.environ["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull
    options = s3_options(s3_endpoint)
    del options["key"], options["secret"]
    options["skip_instance_cache"] = True  # not an s3fs instance that found keys earlier
    uri = f"s3://{s3_bucket}/run"
    storage = Storage(uri, storage_options=options, retries=RETRIES, backoff_s=BACKOFF_S)

    error = _fails_at_once(storage, operation, caplog)

    assert error.failure is Failure.NO_CREDENTIALS
    message = str(error)
    assert f"{OPERATION_VERBS[operation]} {uri}" in message
    assert "no credentials found (Unable to locate credentials)" in message
    assert "AWS_ACCESS_KEY_ID" in message and "key=" in message


# -- a moto server that checks credentials ----------------------------------------------------
@dataclass(frozen=True)
class AuthS3:
    """A moto server that verifies signatures and IAM policies, with one bucket and users."""

    endpoint: str
    bucket: str
    allowed: tuple[str, str]
    """Access key and secret of a user whose policy allows s3:*."""
    denied: tuple[str, str]
    """Access key and secret of a user with no policy at all."""

    def storage(self, key: str, secret: str, endpoint: str | None = None) -> Storage:
        """A Storage on the bucket with these credentials (through ``endpoint`` if given)."""
        options = s3_options(endpoint or self.endpoint, key=key, secret=secret)
        return Storage(
            f"s3://{self.bucket}/run", storage_options=options, retries=RETRIES, backoff_s=BACKOFF_S
        )


@pytest.fixture(scope="module")
def auth_s3() -> Iterator[AuthS3]:
    with checking_moto() as (endpoint, bucket, allowed, denied):
        yield AuthS3(endpoint, bucket, allowed, denied)


@pytest.fixture
def auth_s3_proxy(auth_s3: AuthS3) -> Iterator[FaultyS3Proxy]:
    """A proxy that fails nothing in front of the checking server: it records each request.

    It forwards the Host header unchanged, so the signature the server checks is the one
    the client computed.
    """
    proxy = FaultyS3Proxy(auth_s3.endpoint)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.mark.s3
def test_the_checking_server_accepts_a_user_whose_policy_allows_s3(auth_s3: AuthS3) -> None:
    # The control for the tests below: the refusals there are about their credentials.
    storage = auth_s3.storage(*auth_s3.allowed)
    storage.put("step-000000010/MANIFEST.json", [b"{}"])
    assert storage.read("step-000000010/MANIFEST.json") == bytearray(b"{}")
    assert storage.listdir() == ["step-000000010"]


@pytest.mark.s3
@pytest.mark.parametrize("operation", list(OPERATION_VERBS))
@pytest.mark.parametrize(
    ("credentials", "failure", "says"),
    [
        ("unknown key", Failure.BAD_CREDENTIALS, "InvalidAccessKeyId"),
        ("wrong secret", Failure.BAD_CREDENTIALS, "SignatureDoesNotMatch"),
        ("no permission", Failure.DENIED, "access denied"),
    ],
)
def test_rejected_credentials_and_access_denied_fail_at_once_without_a_retry(
    auth_s3: AuthS3,
    auth_s3_proxy: FaultyS3Proxy,
    caplog: pytest.LogCaptureFixture,
    operation: str,
    credentials: str,
    failure: Failure,
    says: str,
) -> None:
    key, secret = {
        "unknown key": ("AKIAUNKNOWNUNKNOWN00", "whatever"),
        "wrong secret": (auth_s3.denied[0], "not-the-secret"),
        "no permission": auth_s3.denied,
    }[credentials]
    storage = auth_s3.storage(key, secret, endpoint=auth_s3_proxy.endpoint)

    error = _fails_at_once(storage, operation, caplog)

    # A HEAD answer (exists) carries no body: a bare 403 can only be "access denied".
    expected = Failure.DENIED if operation == "exists" else failure
    assert error.failure is expected
    assert f"{OPERATION_VERBS[operation]} s3://{auth_s3.bucket}/run" in str(error)
    if operation != "exists":
        assert says in str(error)
    assert "credentials" in str(error)
    sent = [(method, path) for method, path, _ in auth_s3_proxy.log]
    assert sent and len(sent) == len(set(sent))  # each request went out once: no retry
    assert not isinstance(error, StorageError | OSError)  # no fallback handler swallows it
