"""The pure parts of :mod:`checkflow.storage.s3compat`: the MD5 a MinIO-family server checks,
and which errors mean "this server refuses batch deletes" (real botocore errors, as s3fs
raises them: an ``OSError`` from the ``ClientError``)."""

from __future__ import annotations

import base64
import hashlib

import pytest
from botocore.exceptions import ClientError

from checkflow.storage.s3compat import add_content_md5, batch_delete_refused


def _s3fs_error(code: str, operation: str) -> OSError:
    answer = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": 400}}
    error = OSError(5, f"An error occurred ({code})")
    error.__cause__ = ClientError(answer, operation)  # type: ignore[arg-type]
    return error


def test_the_content_md5_is_the_base64_md5_of_the_final_body() -> None:
    body = b"<Delete><Object><Key>run/step-000000001/MANIFEST.json</Key></Object></Delete>"
    params = {"body": body, "headers": {"x-amz-checksum-crc32": "kept"}}
    add_content_md5(params)
    assert params["headers"] == {
        "x-amz-checksum-crc32": "kept",
        "Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode(),
    }


def test_a_content_md5_already_there_or_a_streamed_body_is_left_alone() -> None:
    params = {"body": b"x", "headers": {"Content-MD5": "theirs"}}
    add_content_md5(params)
    assert params["headers"] == {"Content-MD5": "theirs"}
    streamed = {"body": iter([b"x"]), "headers": {}}
    add_content_md5(streamed)
    assert streamed["headers"] == {}


@pytest.mark.parametrize("code", ["MissingContentMD5", "NotImplemented", "InvalidDigest"])
def test_a_refused_batch_is_told_apart(code: str) -> None:
    assert batch_delete_refused(_s3fs_error(code, "DeleteObjects"))


@pytest.mark.parametrize(
    ("code", "operation"),
    [
        ("AccessDenied", "DeleteObjects"),  # the keys or the credentials: one by one fails too
        ("NoSuchBucket", "DeleteObjects"),
        ("MissingContentMD5", "PutObject"),  # not a batch delete
    ],
)
def test_other_errors_are_not_a_refused_batch(code: str, operation: str) -> None:
    assert not batch_delete_refused(_s3fs_error(code, operation))
    assert not batch_delete_refused(OSError(5, "no S3 answer at all"))
