"""The coordinator's FastAPI application: ``create_app(settings)``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from checkflow_server.api import auth
from checkflow_server.api.admission import Admission, Limits
from checkflow_server.api.deps import require_token
from checkflow_server.api.fastpath import HeartbeatFastPath
from checkflow_server.api.fastproto import heartbeat_protocol
from checkflow_server.api.ratelimit import LoginLimiter
from checkflow_server.api.routes import checkpoints, health, jobs, ranks, tokens
from checkflow_server.api.strict_json import encodable
from checkflow_server.dashboard import routes as dashboard
from checkflow_server.detector import run_detector
from checkflow_server.domain import ownership
from checkflow_server.domain.errors import Conflict, Elsewhere, NotFound, Unavailable
from checkflow_server.flush import run_heartbeat_flush
from checkflow_server.leasing import run_leases
from checkflow_server.repository import Repository
from checkflow_server.repository.tokens import JobTokens
from checkflow_server.service import Coordinator
from checkflow_server.settings import Settings
from checkflow_server.storage_sync import StorageSync
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from checkflow.protocol import ErrorBody, paths

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token"},
    403: {"model": ErrorBody, "description": "A job token used on another job"},
    404: {"model": ErrorBody, "description": "Unknown job, rank or checkpoint"},
    409: {"model": ErrorBody, "description": "Stale generation or conflicting state"},
    413: {"model": ErrorBody, "description": "Body over the coordinator's max_body_bytes"},
}


def create_app(settings: Settings | None = None) -> FastAPI:
    """The coordinator app, its state loaded from ``settings.db`` (migrated first).

    Each process runs one worker: the state it serves is held in memory. On SQLite that is
    every job, so one process per database. On PostgreSQL several processes (replicas) may
    share the database: each serves the jobs it leases (``domain/ownership.py``).
    """
    settings = settings or Settings()
    owner = settings.advertised() if settings.replicated else None
    repository = Repository(
        settings.db, batch_heartbeats=settings.heartbeat_flush_s > 0, owner=owner
    )
    coordinator = Coordinator(
        repository,
        warmup_interval=settings.warmup_interval,
        hang_timeout_s=settings.hang_timeout_s,
    )
    coordinator.load()
    background: set[asyncio.Task[None]] = set()
    app = FastAPI(
        title="checkflow coordinator",
        version="1",
        description="Failure detection, checkpoint frequency and recovery for checkflow jobs.",
        lifespan=_lifespan,
        # Swagger UI and ReDoc load their scripts from a CDN: never served. The document
        # itself only with --docs, behind the token (see api/admission.py).
        docs_url=None,
        redoc_url=None,
        openapi_url=auth.OPENAPI if settings.docs else None,
    )
    app.state.settings = settings
    app.state.coordinator = coordinator
    app.state.tokens = JobTokens(repository.db, shared=settings.replicated)
    keys = auth.Keys(admin=settings.token, job_of=app.state.tokens.job_of)
    app.state.keys = keys
    app.state.background = background
    app.state.storage_sync = StorageSync(
        coordinator, background, enabled=settings.sync_storage, allow=settings.storage_allow
    )

    v1 = APIRouter(prefix=paths.PREFIX, dependencies=[Depends(require_token)], responses=_ERRORS)
    for module in (jobs, tokens, ranks, checkpoints):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(health.router)
    app.include_router(dashboard.router)
    cap = settings.max_body_bytes
    app.add_middleware(HeartbeatFastPath, coordinator=coordinator, keys=keys, max_body_bytes=cap)
    # Added last, so it runs first: the token and the caps before any body is read.
    app.state.login_limiter = LoginLimiter(settings.login_attempts, settings.login_refill_s)
    limits = Limits(keys, settings.docs, cap, settings.max_login_bytes)
    app.add_middleware(Admission, limits=limits, limiter=app.state.login_limiter)
    # For ``checkflow serve``: uvicorn's protocol answering heartbeats without an ASGI task.
    fast = HeartbeatFastPath(None, coordinator, keys, cap)
    app.state.http_protocol = heartbeat_protocol(fast) if settings.fast_protocol else None
    _add_error_handlers(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The running app's background work: WAL checkpoints, the failure detector, storage
    listings; all stopped (and the database closed) at shutdown."""
    settings: Settings = app.state.settings
    coordinator: Coordinator = app.state.coordinator
    background: set[asyncio.Task[None]] = app.state.background
    coordinator.repository.start_checkpointer()
    detector = run_detector(
        coordinator, period_s=settings.detector_period_s, retune_period_s=settings.retune_period_s
    )
    background.add(asyncio.create_task(detector))
    if settings.heartbeat_flush_s > 0:
        flush = run_heartbeat_flush(coordinator.repository, settings.heartbeat_flush_s)
        background.add(asyncio.create_task(flush))
    if coordinator.leases is not None:
        background.add(asyncio.create_task(run_leases(coordinator)))
    for name in list(coordinator.jobs):
        app.state.storage_sync.schedule(name)
    # Everything loaded so far lives as long as the process: keep the collector off it,
    # and collect young objects less often (fewer pauses in the heartbeat tail).
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    try:
        yield
    finally:
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        coordinator.repository.close()


def _add_error_handlers(app: FastAPI) -> None:
    def error(status: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
        async def handler(request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse({"detail": str(exc.args[0] if exc.args else exc)}, status)

        return handler

    app.add_exception_handler(NotFound, error(404))
    app.add_exception_handler(Conflict, error(409))

    async def elsewhere(request: Request, exc: Exception) -> Response:
        # 307, not 302/303: the client repeats the same method with the same body there.
        assert isinstance(exc, Elsewhere)
        target = ownership.location(exc.url, request.url.path, request.url.query)
        body = {"detail": f"served by another replica: {exc.url}"}
        return JSONResponse(body, 307, headers={"location": target})

    async def unavailable(request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": str(exc)}, 503, headers={"retry-after": "1"})

    async def database_error(request: Request, exc: Exception) -> Response:
        # A statement outside the rules' path (a token issued, a list) that failed: the
        # database is unreachable or refused it; the client retries, as after a 503.
        logger.warning("database error on %s %s: %s", request.method, request.url.path, exc)
        return await unavailable(request, Unavailable("the coordinator's database is unavailable"))

    app.add_exception_handler(Elsewhere, elsewhere)
    app.add_exception_handler(Unavailable, unavailable)
    app.add_exception_handler(SQLAlchemyError, database_error)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        # Admission (api/admission.py) answered 401 already when the token is wrong, so a
        # request with no token never learns anything about its body here.
        assert isinstance(exc, RequestValidationError)
        return JSONResponse({"detail": encodable(jsonable_encoder(exc.errors()))}, 422)

    app.add_exception_handler(RequestValidationError, validation)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:
            # FastAPI answers 400 for a body that is not JSON at all; the API promises 422
            # for malformed input (and 401 first when the token is wrong).
            errors = [
                {"type": "json_invalid", "loc": ["body"], "msg": str(exc.detail), "input": None}
            ]
            return await validation(request, RequestValidationError(errors))
        return await http_exception_handler(request, exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
