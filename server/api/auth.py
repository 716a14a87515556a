"""Who a request is, from its headers alone: the one place the coordinator checks a token.

It runs before a request's body is read (:mod:`.admission`), so it sees only the method,
the path and the headers. The dependency :func:`.deps.require_token`, the heartbeat fast
path and the dashboard ask the same functions, so none of them can disagree. Three kinds of
credential: the admin token (``--token-file``/``CHECKFLOW_TOKEN``), a job token (issued
with its job, :mod:`..repository.tokens`) and the dashboard's read-only session cookie.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from checkflow_server.api import session
from starlette.requests import cookie_parser

from checkflow.protocol import paths

_READS = frozenset({"GET", "HEAD"})
_JOBS = f"{paths.PREFIX}/jobs"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request, and what that lets it do."""

    kind: Literal["admin", "job", "session", "anyone"]
    """``admin``: the coordinator's token; ``job``: a job token (its own job only);
    ``session``: the dashboard's cookie (reads only); ``anyone``: the coordinator has no
    token."""
    can_change: bool
    """May change state (POST, PUT, DELETE); False: reads only."""
    job: str | None = None
    """The one job a job token acts on."""


ADMIN = Principal(kind="admin", can_change=True)
ANYONE = Principal(kind="anyone", can_change=True)
SESSION = Principal(kind="session", can_change=False)


@dataclass(frozen=True, slots=True)
class Keys:
    """What a request's credentials are checked against."""

    admin: str | None
    """The coordinator's token (None: it has none, and everyone is let in)."""
    job_of: Callable[[str], str | None]
    """The job a job token was issued for; None: not one (``JobTokens.job_of``)."""


def authorize(
    keys: Keys, method: str, authorization: str | None, cookie: str | None
) -> Principal | None:
    """Who sent a request with these headers; None: nobody the coordinator knows.

    Args:
        keys: the admin token and the job tokens.
        method: the HTTP method: a session cookie is good for reads only.
        authorization: the ``Authorization`` header's value, if any.
        cookie: the ``Cookie`` header's value, if any.
    """
    if keys.admin is None:
        return ANYONE
    if bearer_ok(keys.admin, authorization):
        return ADMIN
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and (job := keys.job_of(value)) is not None:
        return Principal(kind="job", can_change=True, job=job)
    if method in _READS and session.valid(keys.admin, session_cookie(cookie), time.time()):
        return SESSION
    return None


def forbidden(principal: Principal, method: str, path: str) -> str | None:
    """Why ``principal`` may not send ``method path``; None: it may.

    Only a job token is limited here (the session's reads-only rule is in
    :func:`authorize`): it acts on its own job's paths, may ``POST /v1/jobs`` (the route
    lets it create or re-open only its own job), and may not list jobs or issue tokens.
    """
    if principal.kind != "job":
        return None
    if path == _JOBS and method == "POST":
        return None
    if path == _JOBS:
        return "a job token cannot list jobs: use the admin token"
    job, _, rest = path.removeprefix(f"{_JOBS}/").partition("/")
    if not path.startswith(f"{_JOBS}/") or job != principal.job:
        return f"this token belongs to job {principal.job!r}: it cannot act on {path}"
    if rest.partition("/")[0] == "tokens":
        return "a job token cannot issue tokens: use the admin token"
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
