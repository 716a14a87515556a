"""Admission: what a request must pass before any of its body is read.

A hostile client needs no token to send a body, and FastAPI reads and parses a body before
it runs the dependency that checks the token: a 128 MiB ``POST /v1/jobs`` once cost the
server 384 MB and two 200 MB ones stalled every heartbeat for 8 s. This pure-ASGI
middleware, outside FastAPI's routing, decides from the request line and headers alone:

1. ``/login`` from an address out of tries: 429 with ``Retry-After`` (:mod:`.ratelimit`);
2. a protected path (``/v1``, the OpenAPI document) without a principal: 401
   (:func:`.auth.authorize`);
3. a job token on another job's path, or on what only the admin may do: 403
   (:func:`.auth.forbidden`);
4. a ``Content-Length`` over the route's cap: 413.

The principal it found goes to the routes in ``scope["state"]["principal"]``
(``request.state.principal``).

Then it reads the body itself, counting: a chunked body is cut at the cap with 413. Only
then does the app see the request, with the body replayed, so a route can never read more
than the cap. A refusal whose body may still be on its way closes the connection: the
client cannot keep the server parsing bytes nobody reads. The heartbeat parser path
(:mod:`.fastproto`) applies the same cap on its own; what it hands over comes here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from checkflow_server.api import auth
from checkflow_server.api.ratelimit import LoginLimiter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOGIN = "/login"
KEEP_ALIVE_BELOW = 64 << 10
"""A refused request whose declared body is at most this keeps its connection (uvicorn
skips the rest of the body); anything larger or chunked gets ``Connection: close``."""
UNAUTHORIZED = "missing or wrong bearer token: send 'Authorization: Bearer <token>'"


@dataclass(frozen=True, slots=True)
class Limits:
    """The caps and the keys that admission enforces (from the coordinator's settings)."""

    keys: auth.Keys
    docs: bool
    max_body_bytes: int
    max_login_bytes: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer given instead of the app's."""

    status: int
    detail: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class Head:
    """What admission reads of a request: its line, its client and three headers."""

    method: str
    path: str
    client: str
    authorization: str | None
    cookie: str | None
    content_length: int | None


def decide(
    limits: Limits, limiter: LoginLimiter, head: Head, now: float
) -> Refusal | auth.Principal | None:
    """The refusal of a request from its head alone; else read its body (up to the cap)
    and hand it on with its principal (None: a path that needs none)."""
    if head.path == LOGIN and head.method == "POST":
        wait = limiter.retry_after(head.client, now)
        if wait is not None:
            detail = f"too many wrong tokens from {head.client}: try again in {wait} s"
            return Refusal(429, detail, ((b"retry-after", str(wait).encode()),))
    principal = None
    if auth.protected(head.path, limits.docs):
        principal = auth.authorize(limits.keys, head.method, head.authorization, head.cookie)
        if principal is None:
            return Refusal(401, UNAUTHORIZED, ((b"www-authenticate", b"Bearer"),))
        if (why := auth.forbidden(principal, head.method, head.path)) is not None:
            return Refusal(403, why)
    cap = body_cap(limits, head.path)
    if head.content_length is not None and head.content_length > cap:
        return too_large(cap)
    return principal


def body_cap(limits: Limits, path: str) -> int:
    """The most body bytes a request to ``path`` may send."""
    return limits.max_login_bytes if path == LOGIN else limits.max_body_bytes


def too_large(cap: int) -> Refusal:
    return Refusal(413, f"request body over {cap} bytes (the coordinator's max_body_bytes)")


def read_head(scope: Scope) -> Head:
    """The :class:`Head` of an ASGI HTTP scope. A ``Content-Length`` that is not a number
    never gets here: the HTTP parser refuses it (400)."""
    authorization = cookie = length = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"cookie":
            cookie = value.decode("latin-1")
        elif name == b"content-length":
            length = int(value) if value.isdigit() else None
    client = scope.get("client")
    return Head(
        method=scope["method"],
        path=scope["path"],
        client=client[0] if client else "unknown",
        authorization=authorization,
        cookie=cookie,
        content_length=length,
    )


class Admission:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: Limits, limiter: LoginLimiter) -> None:
        self.app = app
        self.limits = limits
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head = read_head(scope)
        decision = decide(self.limits, self.limiter, head, time.monotonic())
        if isinstance(decision, Refusal):
            complete = head.content_length is not None and head.content_length <= KEEP_ALIVE_BELOW
            return await respond(send, decision, close=not complete)
        scope.setdefault("state", {})["principal"] = decision
        cap = body_cap(self.limits, head.path)
        body = await read_capped(receive, cap)
        if body is None:  # the client went away
            return None
        if len(body) > cap:
            return await respond(send, too_large(cap), close=True)
        await self.app(scope, replay(body, receive), send)


async def read_capped(receive: Receive, cap: int) -> bytes | None:
    """The request's body, or its first ``cap + 1`` bytes when it is longer (the caller
    refuses it); None when the client disconnected."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if size > cap:
            return b"".join(chunks)[: cap + 1]
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives ``body`` first as one message, then what ``receive`` gives."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def respond(send: Send, refusal: Refusal, close: bool) -> None:
    """Send ``refusal`` as the documented JSON error body ``{"detail": ...}``."""
    payload = json.dumps({"detail": refusal.detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *refusal.headers,
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
