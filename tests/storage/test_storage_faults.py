"""Storage against an S3 endpoint that fails: a real HTTP proxy in front of moto.

botocore's own retries are off in these storage_options (``total_max_attempts: 1``) and the
proxy answers 500/503 with codes that s3fs does not retry itself, so every retry counted
here is checkflow's. ``faulty_s3`` and ``s3_uri`` share the test's bucket: the first goes
through the proxy, the second straight to moto, to check what really got stored.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from checkflow.storage import Storage, StorageError

pytestmark = pytest.mark.s3

DATA = [b"rank-00000 chunk ", bytes(range(256)) * 64]
WHOLE = b"".join(DATA)


def _retry_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "checkflow.storage" and r.levelno == logging.WARNING
    ]


def _through_proxy(faulty_s3: Any, **kwargs: Any) -> Storage:
    uri, options = faulty_s3
    return Storage(uri, storage_options=options, **kwargs)


def _direct(s3_uri: Any) -> Storage:
    uri, options = s3_uri
    return Storage(uri, storage_options=options, retries=1)


@pytest.mark.parametrize("status", [500, 503])
def test_put_succeeds_after_transient_errors_and_logs_each_retry(
    faulty_s3: Any,
    s3_uri: Any,
    s3_fault_proxy: Any,
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    storage = _through_proxy(faulty_s3, retries=5, backoff_s=0.05)
    s3_fault_proxy.fail("PUT", times=2, status=status)

    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="checkflow.storage"):
        written = storage.put("step-000000010/rank-00000.chunks", DATA)
    elapsed = time.monotonic() - began

    assert written == len(WHOLE)
    assert s3_fault_proxy.count("PUT") == 3  # two refused, the third stored
    warnings = _retry_warnings(caplog)
    assert len(warnings) == 2
    assert "attempt 1/5" in warnings[0] and "attempt 2/5" in warnings[1]
    assert all("step-000000010/rank-00000.chunks" in w for w in warnings)
    assert elapsed >= 0.05 + 0.1  # the backoff doubled between attempts
    assert _direct(s3_uri).read("step-000000010/rank-00000.chunks") == bytearray(WHOLE)


def test_put_survives_dropped_connections(faulty_s3: Any, s3_uri: Any, s3_fault_proxy: Any) -> None:
    # A connection closed without an answer is retried by s3fs itself (it counts it as
    # an HTTPClientError) before checkflow's loop sees anything; either way the object
    # must land whole.
    storage = _through_proxy(faulty_s3, retries=5, backoff_s=0.01)
    s3_fault_proxy.fail("PUT", times=2, status=None)

    storage.put("step-000000010/MANIFEST.json", [b'{"step": 10}'])

    assert s3_fault_proxy.count("PUT") == 3
    assert _direct(s3_uri).read("step-000000010/MANIFEST.json") == bytearray(b'{"step": 10}')


def test_put_gives_up_after_retries_attempts_and_keeps_the_old_object(
    faulty_s3: Any, s3_uri: Any, s3_fault_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _direct(s3_uri).put("MANIFEST.json", [b"old"])
    storage = _through_proxy(faulty_s3, retries=3, backoff_s=0.01)
    s3_fault_proxy.fail("PUT", times=1000, status=503)

    with (
        caplog.at_level(logging.WARNING, logger="checkflow.storage"),
        pytest.raises(StorageError, match=r"write s3://.*/MANIFEST\.json failed after 3 attempts"),
    ):
        storage.put("MANIFEST.json", [b"new"])

    assert s3_fault_proxy.count("PUT") == 3
    assert len(_retry_warnings(caplog)) == 2  # the last failure is raised, not logged
    assert _direct(s3_uri).read("MANIFEST.json") == bytearray(b"old")


def test_ranged_read_succeeds_after_a_transient_error(
    faulty_s3: Any, s3_uri: Any, s3_fault_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _direct(s3_uri).put("blob", DATA)
    storage = _through_proxy(faulty_s3, retries=3, backoff_s=0.01)
    s3_fault_proxy.fail("GET", times=1, status=500)

    with caplog.at_level(logging.WARNING, logger="checkflow.storage"):
        got = storage.read("blob", 17, 17 + 1000)

    assert got == bytearray(WHOLE[17:1017])
    assert s3_fault_proxy.count("GET") == 2
    assert len(_retry_warnings(caplog)) == 1


def test_listing_succeeds_after_a_transient_error(
    faulty_s3: Any, s3_uri: Any, s3_fault_proxy: Any
) -> None:
    direct = _direct(s3_uri)
    direct.put("step-000000001/MANIFEST.json", [b"{}"])
    direct.put("step-000000002/MANIFEST.json", [b"{}"])
    storage = _through_proxy(faulty_s3, retries=3, backoff_s=0.01)
    s3_fault_proxy.fail("GET", times=1, status=503)

    assert storage.listdir() == ["step-000000001", "step-000000002"]
    assert s3_fault_proxy.count("GET") == 2
