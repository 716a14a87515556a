"""The heartbeat fast path: valid heartbeats served without FastAPI's routing and
dependency resolution.

Heartbeats are nearly all the coordinator's traffic (every rank or node, every second).
Profiling showed FastAPI's route matching and dependency solving costing several times the
work itself. This ASGI middleware serves a heartbeat that is well-formed, authorized and
accepted with the same models and the same :class:`Coordinator` call as the documented
routes in ``routes/ranks.py``; anything else (bad token, bad body, unknown job, conflict)
is handed to FastAPI with the body replayed, so errors are exactly the documented ones and
a refused request still has no effect (the coordinator validates before it changes).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from checkflow_server.api.convert import schedule_of
from checkflow_server.coordinator import Conflict, Coordinator, NotFound, RankReport
from pydantic import BaseModel, ValidationError

from checkflow.protocol import (
    Heartbeat,
    HeartbeatReply,
    NodeHeartbeat,
    NodeHeartbeatReply,
    RankAction,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_PATH = re.compile(r"^/v1/jobs/([^/]+)/(ranks|nodes)/([^/]+)/heartbeat$")
_MAX_RANK = 2**31
_MAX_BODY = 1 << 20


class HeartbeatFastPath:
    """ASGI middleware answering accepted heartbeats directly (see the module docstring)."""

    def __init__(self, app: ASGIApp, coordinator: Coordinator, token: str | None) -> None:
        self.app = app
        self.coordinator = coordinator
        self.expected = None if token is None else f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        m = _PATH.match(scope["path"])
        if m is None or not self._acceptable_headers(scope):
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        reply = None if body is None else self._serve(m.group(1), m.group(2), m.group(3), body)
        if reply is None:
            return await self.app(scope, _replay(body or b"", receive), send)
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

    def _acceptable_headers(self, scope: Scope) -> bool:
        auth = ctype = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"content-type":
                ctype = value
        if ctype is None or not ctype.startswith(b"application/json"):
            return False
        if self.expected is None:
            return True
        return auth is not None and hmac.compare_digest(auth, self.expected)

    def _serve(self, job: str, kind: str, who: str, body: bytes) -> BaseModel | None:
        """The reply of an accepted heartbeat; None: let FastAPI answer (it will refuse)."""
        try:
            if kind == "ranks":
                if not who.isdigit() or int(who) > _MAX_RANK:
                    return None
                hb = Heartbeat.model_validate_json(body)
                report = RankReport(
                    int(who), hb.generation, hb.step, hb.iteration_s, hb.stall_s, hb.persist_s
                )
                j, (action,) = self.coordinator.heartbeat(job, [report])
                return HeartbeatReply(
                    action=action,
                    generation=j.generation,
                    interval=j.interval,
                    next_checkpoint_step=j.next_checkpoint_step(),
                    schedule=schedule_of(j),
                )
            if len(who) > 256:
                return None
            node = NodeHeartbeat.model_validate_json(body)
            reports = [
                RankReport(r.rank, r.generation, r.step, r.iteration_s, r.stall_s, r.persist_s)
                for r in node.ranks
            ]
            j, actions = self.coordinator.heartbeat(job, reports, node=who)
        except (ValidationError, NotFound, Conflict):
            return None
        return NodeHeartbeatReply(
            generation=j.generation,
            interval=j.interval,
            next_checkpoint_step=j.next_checkpoint_step(),
            schedule=schedule_of(j),
            ranks=[
                RankAction(rank=r.rank, action=a) for r, a in zip(reports, actions, strict=True)
            ],
        )


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client went away or it is too big."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
