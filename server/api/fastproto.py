"""Heartbeats answered inside uvicorn's HTTP parser callbacks: no ASGI task per request.

:class:`~checkflow_server.api.fastpath.HeartbeatFastPath` skips FastAPI's routing, but every
request still cost uvicorn an ASGI scope, a response cycle with its event, an asyncio task,
the middleware stack, and two socket writes (headers, then body). At thousands of
heartbeats a second on one core that was most of the CPU a heartbeat costs, and the
latency target is below a millisecond. This protocol (uvicorn's httptools one, subclassed)
serves an accepted heartbeat when its last byte is parsed, with the same
:meth:`HeartbeatFastPath.serve` and so the same rules and reply, and writes the response in
one write. Everything else takes uvicorn's ordinary path: another method or path, a body
the fast path refuses (the request is handed over with its body, so the error is FastAPI's
documented one), a declared or counted body over ``max_body_bytes`` (handed over at
once, so :mod:`.admission` answers 413 having buffered at most the cap),
``Connection: close``, a pipelined request behind one still being answered (replies stay
in order), or a client not reading its replies.
"""

from __future__ import annotations

from typing import Any

from checkflow_server.api.fastpath import HeartbeatFastPath, heartbeat_target

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn without httptools: the ASGI fast path alone serves heartbeats
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


_Base: Any = HttpToolsProtocol if HttpToolsProtocol is not None else object


class _HeartbeatProtocol(_Base):
    """The protocol; :func:`heartbeat_protocol` makes a subclass bound to one fast path."""

    fastpath: HeartbeatFastPath
    _fast: tuple[bool, str, str] | None = None
    _body: list[bytes]
    _size = 0

    def on_headers_complete(self) -> None:
        self._fast = self._fast_target()
        if self._fast is None:
            super().on_headers_complete()
        else:
            self._body, self._size = [], 0

    def _fast_target(self) -> tuple[bool, str, str] | None:
        busy = self.cycle is not None and not self.cycle.response_complete
        if (
            busy
            or self.pipeline
            or self.flow.write_paused
            or self.parser.get_method() != b"POST"
            or self.parser.get_http_version() != "1.1"
            or not self.parser.should_keep_alive()
            or self.parser.should_upgrade()
            or self.expect_100_continue
        ):
            return None
        raw = httptools.parse_url(self.url).path
        if b"%" in raw or not raw.isascii():
            return None  # quoted: uvicorn's path decoding, then the ASGI fast path
        target = heartbeat_target(raw.decode("ascii"))
        if target is None or not self.fastpath.acceptable(self.headers, target[1]):
            return None
        return target

    def on_body(self, body: bytes) -> None:
        if self._fast is None:
            return super().on_body(body)
        self._body.append(body)
        self._size += len(body)
        if self._size > self.fastpath.max_body_bytes:  # not a heartbeat: admission's 413
            self._hand_over()

    def on_message_complete(self) -> None:
        if self._fast is None:
            return super().on_message_complete()
        one_rank, job, who = self._fast
        reply = self.fastpath.serve(one_rank, job, who, b"".join(self._body))
        if reply is None:
            self._hand_over()
            return super().on_message_complete()
        self._fast = None
        payload = reply.model_dump_json().encode()
        head = [b"HTTP/1.1 200 OK\r\n"]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload))
        self.transport.write(b"".join(head) + payload)
        self.on_response_complete()  # counts it, arms the keep-alive timeout

    def _hand_over(self) -> None:
        """uvicorn's ordinary path for this request, with the body read so far."""
        body = b"".join(self._body)
        self._fast, self._body = None, []
        super().on_headers_complete()
        super().on_body(body)


def heartbeat_protocol(fastpath: HeartbeatFastPath) -> type[Any] | None:
    """uvicorn's ``http`` protocol class serving ``fastpath``'s heartbeats in the parser;
    None when httptools (or this uvicorn's protocol) is not there."""
    if HttpToolsProtocol is None:
        return None
    return type("HeartbeatProtocol", (_HeartbeatProtocol,), {"fastpath": fastpath})
