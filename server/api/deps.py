"""Dependencies of the API handlers, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api import auth
from checkflow_server.service import Coordinator
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="The coordinator's token (--token).")


def authorized(request: Request) -> bool:
    """Whether ``request`` may read: :func:`.auth.authorize` knows who sent it."""
    return principal(request) is not None


def principal(request: Request) -> auth.Principal | None:
    """Who sent ``request`` (see :func:`.auth.authorize`); None: nobody known."""
    return auth.authorize(
        request.app.state.keys,
        request.method,
        request.headers.get("authorization"),
        request.headers.get("cookie"),
    )


# async: a plain def dependency would run in the threadpool, a context switch per request.
async def require_token(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    # Admission (api/admission.py) already decided; asked again here so a route is never
    # reached by a path around it.
    who = principal(request)
    if who is None:
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if (why := auth.forbidden(who, request.method, request.scope["path"])) is not None:
        raise HTTPException(status_code=403, detail=why)
    request.state.principal = who


async def get_principal(request: Request) -> auth.Principal:
    """The principal :func:`require_token` found (every ``/v1`` route depends on it)."""
    who: auth.Principal = request.state.principal
    return who


PrincipalDep = Annotated[auth.Principal, Depends(get_principal)]
"""Who sent the request: the admin, a job's token, the dashboard's session, or anyone."""


async def get_coordinator(request: Request) -> Coordinator:
    coordinator: Coordinator = request.app.state.coordinator
    return coordinator


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
"""The coordinator service that owns this app's state."""
