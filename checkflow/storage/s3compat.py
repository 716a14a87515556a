"""S3 servers other than AWS: what their deletes need that botocore no longer sends.

botocore 1.36 (aiobotocore 2.18) stopped sending ``Content-MD5``; it sends a CRC32 checksum
header instead. AWS takes either. MinIO and servers built on its code (the JuiceFS S3
gateway, older Ceph RGW…) refuse a batch delete (``DeleteObjects``) without the MD5 with
``400 MissingContentMD5`` (fsspec/s3fs#931), so retention deleted nothing there and storage
grew without bound. Two remedies, both here:

- :func:`send_content_md5` makes the client send the MD5 again (one request per 1000 keys,
  as before);
- :func:`batch_delete_refused` tells a refused batch from other errors, so that
  :class:`~checkflow.storage.store.Storage` deletes those objects one at a time
  (``DeleteObject`` needs no body, so no checksum) on a server that refuses batches anyway.

Pure functions over the client and the exception: no import of botocore or s3fs.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

DELETE_OBJECTS_EVENT = "before-call.s3.DeleteObjects"
"""botocore's event before a batch delete is signed; ``params`` then holds the final body."""
_HANDLER_ID = "checkflow-content-md5"

BATCH_REFUSAL_CODES = frozenset(
    {
        "MissingContentMD5",  # MinIO family without Content-MD5
        "InvalidDigest",  # a Content-MD5 the server computed differently
        "BadDigest",
        "NotImplemented",  # a gateway with no DeleteObjects at all
        "XAmzContentSHA256Mismatch",
    }
)
"""S3 error codes of a refused ``DeleteObjects`` that one ``DeleteObject`` per key avoids."""


def add_content_md5(params: dict[str, Any], **_: Any) -> None:
    """botocore ``before-call`` handler: set ``Content-MD5`` of the request body."""
    body = params.get("body")
    headers = params.setdefault("headers", {})
    if isinstance(body, bytes | bytearray) and "Content-MD5" not in headers:
        digest = hashlib.md5(body, usedforsecurity=False).digest()
        headers["Content-MD5"] = base64.b64encode(digest).decode("ascii")


def send_content_md5(fs: Any, enabled: bool = True) -> None:
    """Make ``fs``'s S3 client send ``Content-MD5`` with batch deletes (or stop: ``enabled``
    False); nothing for other filesystems. Idempotent and cheap: call it before every
    delete, since s3fs makes a new client when its session is refreshed."""
    if "s3" not in _protocols(fs):
        return
    events = fs.s3.meta.events  # connects on first use, like any s3fs call
    if enabled:
        events.register(DELETE_OBJECTS_EVENT, add_content_md5, unique_id=_HANDLER_ID)
    else:
        events.unregister(DELETE_OBJECTS_EVENT, unique_id=_HANDLER_ID)


def batch_delete_refused(error: BaseException) -> bool:
    """Whether ``error`` is a server refusing ``DeleteObjects`` itself (not the keys, not the
    credentials): then deleting the same objects one at a time can work."""
    current: BaseException | None = error
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            operation = getattr(current, "operation_name", "DeleteObjects")
            return operation == "DeleteObjects" and code in BATCH_REFUSAL_CODES
        current = current.__cause__
    return False


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
