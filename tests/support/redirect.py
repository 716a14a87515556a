"""Real HTTP servers on 127.0.0.1 for the failover tests: one that answers every request
with a 307 to another server (a replica pointing at a job's owner, or a hostile one), one
that records what reaches it, and a port that accepts connections and never answers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Seen:
    """The requests a server got: method, path, headers (lower-cased names), body."""

    requests: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, handler: BaseHTTPRequestHandler) -> None:
        size = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(size) if size else b""
        headers = {k.lower(): v for k, v in handler.headers.items()}
        with self.lock:
            self.requests.append((handler.command, handler.path, headers, body))


def _handler(seen: Seen, answer: tuple[int, dict[str, str], bytes], to: str | None) -> type:
    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            seen.add(self)
            code, headers, body = answer
            self.send_response(code)
            if to is not None:
                self.send_header("Location", to + self.path)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _any

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def http_server(
    code: int = 200, body: bytes = b"{}", redirect_to: str | None = None
) -> Iterator[tuple[str, Seen]]:
    """A server answering ``code`` and ``body`` to everything (with ``Location:
    redirect_to + path`` when given); yields its URL and what it saw."""
    seen = Seen()
    headers = {"Content-Type": "application/json"}
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), _handler(seen, (code, headers, body), redirect_to)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextmanager
def silent_port() -> Iterator[str]:
    """A URL whose port accepts connections (the kernel's backlog) and never answers: a
    coordinator host that hangs, so each request to it lasts its whole timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
