"""Who a request is, from its headers alone: the one place the coordinator checks a token.

It runs before a request's body is read (:mod:`.admission`), so it sees only the method,
the path and the headers. The dependency :func:`.deps.require_token` and the dashboard ask
the same function, so the routes, the page and the admission check cannot disagree.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Literal

from checkflow_server.api import session
from starlette.requests import cookie_parser

from checkflow.protocol import paths

_READS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request, and what that lets it do."""

    kind: Literal["admin", "session", "anyone"]
    """``admin``: the coordinator's token; ``session``: the dashboard's cookie (reads only);
    ``anyone``: the coordinator has no token."""
    can_change: bool
    """May change state (POST, PUT, DELETE); False: reads only."""


ADMIN = Principal(kind="admin", can_change=True)
ANYONE = Principal(kind="anyone", can_change=True)
SESSION = Principal(kind="session", can_change=False)


def authorize(
    token: str | None, method: str, authorization: str | None, cookie: str | None
) -> Principal | None:
    """Who sent a request with these headers; None: nobody the coordinator knows.

    Args:
        token: the coordinator's token (None: it has none, and everyone is let in).
        method: the HTTP method: a session cookie is good for reads only.
        authorization: the ``Authorization`` header's value, if any.
        cookie: the ``Cookie`` header's value, if any.
    """
    if token is None:
        return ANYONE
    if bearer_ok(token, authorization):
        return ADMIN
    if method in _READS and session.valid(token, session_cookie(cookie), time.time()):
        return SESSION
    return None


def bearer_ok(token: str, authorization: str | None) -> bool:
    """Whether ``authorization`` is ``Bearer <token>`` (compared in constant time)."""
    scheme, _, value = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), token.encode())


def session_cookie(cookie: str | None) -> str | None:
    """The dashboard's session cookie out of a ``Cookie`` header (parsed as Starlette's
    ``request.cookies`` does); None when absent."""
    return cookie_parser(cookie).get(session.COOKIE) if cookie else None


def protected(path: str, docs: bool) -> bool:
    """Whether ``path`` needs a principal: the API, and the OpenAPI document when served."""
    return path == paths.PREFIX or path.startswith(f"{paths.PREFIX}/") or (docs and path == OPENAPI)


OPENAPI = "/openapi.json"
"""Where ``--docs`` serves the OpenAPI document."""
