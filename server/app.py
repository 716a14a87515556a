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
from checkflow_server.coordinator import Conflict, Coordinator, NotFound
from checkflow_server.db import Store
from checkflow_server.detector import run_detector
from checkflow_server.settings import Settings
from checkflow_server.storage_sync import committed_steps
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from checkflow.protocol import ErrorBody

logger = logging.getLogger(__name__)

API_VERSION = "v1"
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
    store = Store(settings.db)
    coordinator = Coordinator(store, warmup_interval=settings.warmup_interval)
    coordinator.load()

    async def sync_storage(name: str) -> None:
        job = coordinator.jobs.get(name)
        if job is None or not job.storage_uri:
            return
        steps = await asyncio.to_thread(committed_steps, job.storage_uri)
        added = coordinator.add_storage_commits(name, steps)  # back on the loop: SQLite here
        if added:
            logger.info("job %s: %d committed checkpoints found on storage", name, added)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = app.state.background
        store.start_checkpointer()
        tasks.add(
            asyncio.create_task(
                run_detector(
                    coordinator,
                    period_s=settings.detector_period_s,
                    retune_period_s=settings.retune_period_s,
                )
            )
        )
        if settings.sync_storage:
            for name in list(coordinator.jobs):
                tasks.add(asyncio.create_task(sync_storage(name)))
        # Everything loaded so far lives as long as the process: keep the collector off it,
        # and collect young objects less often (fewer pauses in the heartbeat tail).
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            store.close()

    app = FastAPI(
        title="checkflow coordinator",
        version="1",
        description="Failure detection, checkpoint frequency and recovery for checkflow jobs.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.coordinator = coordinator
    app.state.background = set()
    app.state.storage_sync = sync_storage if settings.sync_storage else None

    v1 = APIRouter(
        prefix=f"/{API_VERSION}", dependencies=[Depends(require_token)], responses=_ERRORS
    )
    for module in (jobs, ranks, checkpoints):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(health.router)
    app.add_middleware(HeartbeatFastPath, coordinator=coordinator, token=settings.token)
    _add_error_handlers(app)
    return app


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
        if request.url.path.startswith(f"/{API_VERSION}/") and not token_ok(
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
