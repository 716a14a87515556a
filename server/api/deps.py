"""Dependencies of the API handlers, as ``Annotated`` aliases."""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from checkflow_server.api import session
from checkflow_server.service import Coordinator
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="The coordinator's token (--token).")


def token_ok(request: Request, header: str | None) -> bool:
    """Whether ``header`` (the Authorization value) carries the configured token."""
    token: str | None = request.app.state.settings.token
    if token is None:
        return True
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), token.encode())


def authorized(request: Request) -> bool:
    """Whether ``request`` may read: the token in its Authorization header or, for a read
    (GET or HEAD), the dashboard's session cookie (:mod:`.session`). Changes need the header."""
    if token_ok(request, request.headers.get("authorization")):
        return True
    token: str = request.app.state.settings.token
    cookie = request.cookies.get(session.COOKIE)
    return request.method in ("GET", "HEAD") and session.valid(token, cookie, time.time())


# async: a plain def dependency would run in the threadpool, a context switch per request.
async def require_token(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    if not authorized(request):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def get_coordinator(request: Request) -> Coordinator:
    coordinator: Coordinator = request.app.state.coordinator
    return coordinator


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
"""The coordinator service that owns this app's state."""
