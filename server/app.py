"""The coordinator's FastAPI application: ``create_app(settings)``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from checkflow_server.api.deps import require_token, token_ok
from checkflow_server.api.fastpath import HeartbeatFastPath
from checkflow_server.api.routes import checkpoints, health, jobs, ranks
from checkflow_server.dashboard import routes as dashboard
from checkflow_server.detector import run_detector
from checkflow_server.domain.errors import Conflict, NotFound
from checkflow_server.repository import Repository
from checkflow_server.service import Coordinator
from checkflow_server.settings import Settings
from checkflow_server.storage_sync import StorageSync
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from checkflow.protocol import ErrorBody, paths

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token"},
    404: {"model": ErrorBody, "description": "Unknown job, rank or checkpoint"},
    409: {"model": ErrorBody, "description": "Stale generation or conflicting state"},
}


def create_app(settings: Settings | None = None) -> FastAPI:
    """The coordinator app, its state loaded from ``settings.db``.

    Run it with exactly one worker process: the state is held in memory and written
    through to SQLite, so two processes would disagree.
    """
    settings = settings or Settings()
    coordinator = Coordinator(
        Repository(settings.db),
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
    )
    app.state.settings = settings
    app.state.coordinator = coordinator
    app.state.background = background
    app.state.storage_sync = StorageSync(coordinator, background, enabled=settings.sync_storage)

    v1 = APIRouter(prefix=paths.PREFIX, dependencies=[Depends(require_token)], responses=_ERRORS)
    for module in (jobs, ranks, checkpoints):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(health.router)
    app.include_router(dashboard.router)
    app.add_middleware(HeartbeatFastPath, coordinator=coordinator, token=settings.token)
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

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        # FastAPI parses the body before running dependencies: without this, a request
        # with no token and a bad body would learn about the body instead of getting 401.
        if request.url.path.startswith(f"{paths.PREFIX}/") and not token_ok(
            request, request.headers.get("authorization")
        ):
            return JSONResponse(
                {"detail": "missing or wrong bearer token: send 'Authorization: Bearer <token>'"},
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        assert isinstance(exc, RequestValidationError)
        return await request_validation_exception_handler(request, exc)

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
