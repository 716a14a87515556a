"""The dashboard's routes: the page at ``/``, its files, and signing in and out.

The page holds no data: its script reads the ``/v1`` API with the browser's session cookie.
The token travels only in an Authorization header or in the body of the login form's POST,
never in a URL (URLs land in access logs, proxies and browser history).
"""

from __future__ import annotations

import hmac
import time
from urllib.parse import parse_qs

from checkflow_server.api import session
from checkflow_server.api.deps import authorized
from checkflow_server.dashboard import assets
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

router = APIRouter(include_in_schema=False)

_HEADERS = {
    # Scripts, styles and connections from this coordinator only: no CDN can be added by
    # mistake, and no injected inline script runs.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


@router.get("/", response_class=HTMLResponse)
async def dashboard(request: Request) -> HTMLResponse:
    """The dashboard when the request is signed in (or the coordinator has no token), else
    the sign-in form with status 401."""
    if authorized(request):
        return HTMLResponse(assets.page(), headers=_HEADERS)
    return HTMLResponse(assets.login_page(), 401, headers=_HEADERS)


@router.post("/login", response_model=None)
async def login(request: Request) -> Response:
    """Check the form's token; on success set the session cookie and go back to ``/``.

    Admission (``api/admission.py``) has capped the form's size and refused an address out
    of tries before this runs; a wrong token here takes one of its tries."""
    token: str | None = request.app.state.settings.token
    if token is None:
        return RedirectResponse("/", 303)
    body = await request.body()
    given = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        client = request.client.host if request.client else "unknown"
        request.app.state.login_limiter.failed(client, time.monotonic())
        error = "Wrong token: enter the coordinator's token (its --token or token file)."
        return HTMLResponse(assets.login_page(error), 401, headers=_HEADERS)
    response = RedirectResponse("/", 303, headers=_HEADERS)
    response.set_cookie(
        session.COOKIE,
        session.issue(token, time.time()),
        max_age=session.MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout() -> RedirectResponse:
    response = RedirectResponse("/", 303, headers=_HEADERS)
    response.delete_cookie(session.COOKIE, httponly=True, samesite="strict")
    return response


@router.get("/dashboard/{name}")
async def asset(name: str) -> Response:
    """The page's script and style sheet (no token: they hold no data)."""
    media_type = assets.ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"no dashboard file {name!r}")
    return Response(assets.read(name), media_type=media_type, headers=_HEADERS)
