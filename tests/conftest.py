"""Fixtures shared by the whole suite.

S3 is a real S3 HTTP endpoint (moto's server) on 127.0.0.1, started once per session on a
free port and stopped at the end. Nothing here can reach real AWS: the process runs with
fake credentials, no AWS profile or config file, no proxies, and (once the endpoint is up)
``AWS_ENDPOINT_URL_S3`` pointing at moto, so even an ``s3://`` URI opened without
``storage_options`` lands on moto.

Use it like this::

    def test_save_to_s3(s3_uri):                  # a fresh, empty bucket per test
        uri, storage_options = s3_uri             # "s3://checkflow-1a2b3c4d/run", {...}
        Storage(uri, storage_options=storage_options)
        subprocess.run([...], env={**os.environ, **s3_uri.env})   # children find moto too

Fixtures:
    s3_endpoint: ``"http://127.0.0.1:<port>"`` of the session's moto server.
    s3_bucket: a new, empty bucket name for this test.
    s3_uri: an :class:`S3Location` (``uri``, ``storage_options``, ``env``) in a new bucket.
    s3_fault_proxy: a :class:`FaultyS3Proxy` in front of moto that fails the requests a
        test asks it to (``s3_fault_proxy.fail("PUT", times=2, status=503)``).
    faulty_s3: an :class:`S3Location` in a new bucket whose endpoint is ``s3_fault_proxy``.
Helper:
    s3_options(endpoint, **overrides): ``storage_options`` for s3fs aimed at ``endpoint``.
"""

from __future__ import annotations

import functools
import http.client
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # No profile, config or credentials file of the person running the tests gets read.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
_DROPPED_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
_DROPPED_ENV += ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")


def _isolate_from_real_aws() -> None:
    # Done at import, before any test module imports boto/s3fs, and inherited by every
    # subprocess the tests start (ranks, the CLI, the coordinator).
    for name in _DROPPED_ENV:
        os.environ.pop(name, None)
    os.environ.update(_FAKE_AWS_ENV)


_isolate_from_real_aws()


@dataclass(frozen=True)
class S3Location:
    """Where a test may write on the moto endpoint; unpacks as ``uri, storage_options``."""

    uri: str
    """``s3://<bucket>/run``."""
    storage_options: dict[str, Any]
    """For ``Storage(uri, storage_options=...)`` / fsspec: credentials and endpoint."""
    env: dict[str, str]
    """Environment for a subprocess to reach the same endpoint without storage_options."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.uri, self.storage_options))


def s3_options(endpoint: str, **overrides: Any) -> dict[str, Any]:
    """``storage_options`` for s3fs talking to ``endpoint`` with the fake credentials.

    botocore's own retries are off (``total_max_attempts: 1``; its legacy
    ``max_attempts`` counts retries, not attempts) so that a failure reaches
    checkflow's retry loop, which is what the tests exercise; pass ``config_kwargs`` to
    change that.
    """
    options: dict[str, Any] = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 5},
    }
    options.update(overrides)
    return options


def _env_for(endpoint: str) -> dict[str, str]:
    return {**_FAKE_AWS_ENV, "AWS_ENDPOINT_URL_S3": endpoint}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1:<free port> for the whole session."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO; the tests' output should show failures only.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    try:
        yield endpoint
    finally:
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on the session's endpoint."""
    import boto3

    name = f"checkflow-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_uri(s3_endpoint: str, s3_bucket: str) -> S3Location:
    """``s3://<new bucket>/run`` with the storage_options and env that reach it."""
    return S3Location(f"s3://{s3_bucket}/run", s3_options(s3_endpoint), _env_for(s3_endpoint))


# -- fault injection -----------------------------------------------------------------------


@dataclass
class _Fault:
    method: str
    remaining: int
    status: int | None  # None: drop the connection without an answer


@dataclass
class FaultyS3Proxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint that fails chosen requests.

    Every request is forwarded unchanged unless a fault registered with :meth:`fail`
    matches it; then the proxy answers an S3-style error (or closes the connection) and
    moto never sees the request. ``log`` records ``(method, path, status)`` for every
    request, with status ``None`` for a dropped one.
    """

    upstream: str
    log: list[tuple[str, str, int | None]] = field(default_factory=list)
    _faults: list[_Fault] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def fail(self, method: str, times: int, status: int | None = 500) -> None:
        """Fail the next ``times`` requests with ``method`` (``status=None``: drop them)."""
        with self._lock:
            self._faults.append(_Fault(method.upper(), times, status))

    def count(self, method: str) -> int:
        """How many ``method`` requests reached the proxy, failed or not."""
        with self._lock:
            return sum(1 for m, _, _ in self.log if m == method.upper())

    def start(self) -> None:
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        serve = functools.partial(self._server.serve_forever, poll_interval=0.05)
        threading.Thread(target=serve, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _take_fault(self, method: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.method == method and fault.remaining > 0:
                    fault.remaining -= 1
                    return fault
        return None

    def _record(self, method: str, path: str, status: int | None) -> None:
        with self._lock:
            self.log.append((method, path, status))


_ERROR_CODES = {500: "InternalError", 503: "ServiceUnavailable"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class _ProxyHandler(BaseHTTPRequestHandler):
    owner: FaultyS3Proxy
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass  # the proxy's log list is the record; stderr noise helps nobody

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._chunked_body()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _chunked_body(self) -> bytes:
        # Keep the raw chunked framing: it is what the client signed and what moto decodes.
        raw = bytearray()
        while True:
            line = self.rfile.readline()
            raw += line
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            raw += self.rfile.read(size + 2)
        while True:  # trailers, then the blank line
            line = self.rfile.readline()
            raw += line
            if line in (b"\r\n", b"\n", b""):
                return bytes(raw)

    def _handle(self) -> None:
        body = self._body()
        fault = self.owner._take_fault(self.command)
        if fault is not None:
            self.owner._record(self.command, self.path, fault.status)
            if fault.status is None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            else:
                self._send_error(fault.status)
            return
        status, headers, payload = self._forward(body)
        self.owner._record(self.command, self.path, status)
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        # A HEAD answer carries the object's length with no body; keep moto's value.
        upstream_length = {k.lower(): v for k, v in headers}.get("content-length", "0")
        length = upstream_length if self.command == "HEAD" else str(len(payload))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        host = self.owner.upstream.removeprefix("http://")
        conn = http.client.HTTPConnection(host, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _send_error(self, status: int) -> None:
        code = _ERROR_CODES.get(status, "InternalError")
        payload = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected by the test proxy</Message></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


@pytest.fixture
def s3_fault_proxy(s3_endpoint: str) -> Iterator[FaultyS3Proxy]:
    """A :class:`FaultyS3Proxy` in front of the session's endpoint, for this test only."""
    proxy = FaultyS3Proxy(s3_endpoint)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def faulty_s3(s3_fault_proxy: FaultyS3Proxy, s3_bucket: str) -> S3Location:
    """A new bucket reached through ``s3_fault_proxy``: ask for both fixtures in a test."""
    endpoint = s3_fault_proxy.endpoint
    return S3Location(f"s3://{s3_bucket}/run", s3_options(endpoint), _env_for(endpoint))
