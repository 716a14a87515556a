"""The heartbeat fast path: valid heartbeats served without FastAPI's routing and
dependency resolution.

Heartbeats are nearly all the coordinator's traffic (every rank or node, every second).
Profiling showed FastAPI's route matching and dependency solving costing several times the
work itself. This ASGI middleware serves a heartbeat that is well-formed, authorized and
accepted with the same models and the same :class:`Coordinator` methods as the documented
routes in ``routes/ranks.py`` (the reply is built once, by the rule); anything else (bad
token, bad body, unknown job, conflict) is handed to FastAPI with the body replayed, so
errors are exactly the documented ones and a refused request still has no effect (the
rules validate before they change anything). It sits behind :mod:`.admission`, which has
already checked the token and capped the body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from checkflow_server.api import auth
from checkflow_server.api.admission import read_capped, replay
from checkflow_server.domain.errors import Conflict, Elsewhere, NotFound, Unavailable
from checkflow_server.service import Coordinator
from pydantic import BaseModel, ValidationError

from checkflow.protocol import MAX_NODE_NAME, MAX_RANK, Heartbeat, NodeHeartbeat, paths

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_RANK_PATH = paths.pattern(paths.RANK_HEARTBEAT)
_NODE_PATH = paths.pattern(paths.NODE_HEARTBEAT)


def heartbeat_target(path: str) -> tuple[bool, str, str] | None:
    """(one rank?, job, rank or node) when ``path`` is a heartbeat's; None otherwise."""
    m = _RANK_PATH.match(path) or _NODE_PATH.match(path)
    if m is None:
        return None
    job, who = m.groups()
    return m.re is _RANK_PATH, job, who


class HeartbeatFastPath:
    """ASGI middleware answering accepted heartbeats directly (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp | None,
        coordinator: Coordinator,
        keys: auth.Keys,
        max_body_bytes: int = 1 << 20,
    ) -> None:
        """``app``: the ASGI app behind this middleware (None: only :meth:`serve` is used);
        ``max_body_bytes``: a longer body is not a heartbeat (FastAPI's path refuses it)."""
        self.app = app
        self.coordinator = coordinator
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self._next(scope, receive, send)
        target = heartbeat_target(scope["path"])
        if target is None or not self.acceptable(scope["headers"], target[1]):
            return await self._next(scope, receive, send)
        body = await read_capped(receive, self.max_body_bytes)
        reply = None
        if body is not None and len(body) <= self.max_body_bytes:
            reply = self.serve(*target, body)
        if reply is None:
            return await self._next(scope, replay(body or b"", receive), send)
        payload = reply.model_dump_json().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _next(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None, "HeartbeatFastPath(None, ...) is not an ASGI middleware"
        await self.app(scope, receive, send)

    def acceptable(self, headers: list[tuple[bytes, bytes]], job: str) -> bool:
        """JSON, a declared body within the cap (a chunked one is counted as it comes), and
        a token that may act on ``job`` (anything else goes to FastAPI, whose admission
        answers 401 or 403)."""
        authorization = ctype = None
        for name, value in headers:
            if name == b"authorization":
                authorization = value
            elif name == b"content-type":
                ctype = value
            elif name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return False
        if ctype is None or not ctype.startswith(b"application/json"):
            return False
        if self.keys.admin is None:
            return True
        if authorization is None:
            return False
        who = auth.authorize(self.keys, "POST", authorization.decode("latin-1"), None)
        return who is not None and who.kind != "session" and (who.job in (None, job))

    def serve(self, one_rank: bool, job: str, who: str, body: bytes) -> BaseModel | None:
        """The reply of an accepted heartbeat; None: let FastAPI answer (it will refuse)."""
        try:
            if one_rank:
                if not (who.isascii() and who.isdigit()) or int(who) > MAX_RANK:
                    return None
                hb = Heartbeat.model_validate_json(body)
                return self.coordinator.rank_heartbeat(job, int(who), hb)
            if len(who) > MAX_NODE_NAME:
                return None
            node = NodeHeartbeat.model_validate_json(body)
            return self.coordinator.node_heartbeat(job, who, node)
        except (ValidationError, NotFound, Conflict, Elsewhere, Unavailable):
            return None
