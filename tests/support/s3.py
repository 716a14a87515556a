"""S3 for the tests: fake credentials, ``storage_options`` for moto, and a fault proxy.

Nothing here can reach real AWS: :func:`isolate_from_real_aws` (called by the root
conftest at import, before any test module imports boto or s3fs, and inherited by every
subprocess) sets fake credentials and drops profiles, config files, endpoints and proxies.
The fixtures built on these helpers live in ``tests/conftest.py``.
"""

from __future__ import annotations

import functools
import http.client
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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


def isolate_from_real_aws() -> None:
    """Fake credentials, no profile, endpoint or proxy, for this process and its children."""
    for name in _DROPPED_ENV:
        os.environ.pop(name, None)
    os.environ.update(_FAKE_AWS_ENV)


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


def env_for(endpoint: str) -> dict[str, str]:
    """Environment for a subprocess to reach ``endpoint`` without storage_options."""
    return {**_FAKE_AWS_ENV, "AWS_ENDPOINT_URL_S3": endpoint}


@dataclass
class _Fault:
    method: str
    remaining: int
    status: int | None  # None: drop the connection without an answer


@dataclass
class Outage:
    """The endpoint down: every connection dropped from ``start`` for ``seconds``."""

    seconds: float
    trigger: Callable[[str, str], bool] | None
    """Starts the outage at the first request ``(method, path)`` it accepts; None: at once."""
    start: float | None = None
    """``time.time()`` when it started; None while it waits for its trigger."""
    started: threading.Event = field(default_factory=threading.Event)

    @property
    def end(self) -> float | None:
        return None if self.start is None else self.start + self.seconds

    def dropping(self, method: str, path: str | None, now: float) -> bool:
        """Whether a request (``path`` None: a new connection) is dropped at ``now``;
        starts the outage when the request is its trigger."""
        if self.start is None:
            if path is None or self.trigger is None or not self.trigger(method, path):
                return False
            self.start = now
            self.started.set()
        return now < self.start + self.seconds


@dataclass
class FaultyS3Proxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint that fails chosen requests.

    Every request is forwarded unchanged unless a fault registered with :meth:`fail`
    matches it; then the proxy answers an S3-style error (or closes the connection) and
    moto never sees the request. During an :meth:`outage` every connection is closed as
    soon as it is accepted, and every request on one already open is dropped. ``log``
    records ``(method, path, status)`` for every request, with status ``None`` for a
    dropped one.
    """

    upstream: str
    log: list[tuple[str, str, int | None]] = field(default_factory=list)
    _faults: list[_Fault] = field(default_factory=list)
    _outages: list[Outage] = field(default_factory=list)
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

    def outage(self, seconds: float, *, when: Callable[[str, str], bool] | None = None) -> Outage:
        """Take the endpoint down for ``seconds``: now, or from the first request
        ``(method, path)`` for which ``when`` is true (that request is dropped too)."""
        outage = Outage(seconds, when)
        if when is None:
            outage.start = time.time()
            outage.started.set()
        with self._lock:
            self._outages.append(outage)
        return outage

    def count(self, method: str) -> int:
        """How many ``method`` requests reached the proxy, failed or not."""
        with self._lock:
            return sum(1 for m, _, _ in self.log if m == method.upper())

    def start(self) -> None:
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        class Server(ThreadingHTTPServer):
            def verify_request(self, request: Any, client_address: Any) -> bool:
                # False closes the connection at once: the endpoint is down.
                return not proxy._dropping("CONNECT", None)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        serve = functools.partial(self._server.serve_forever, poll_interval=0.05)
        threading.Thread(target=serve, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _dropping(self, method: str, path: str | None) -> bool:
        now = time.time()
        with self._lock:
            return any([o.dropping(method, path, now) for o in self._outages])

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
        if self.owner._dropping(self.command, self.path):
            self.owner._record(self.command, self.path, None)
            self._drop()
            return
        fault = self.owner._take_fault(self.command)
        if fault is not None:
            self.owner._record(self.command, self.path, fault.status)
            if fault.status is None:
                self._drop()
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

    def _drop(self) -> None:
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

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
