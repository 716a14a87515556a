"""Liveness and Prometheus metrics (no token: probes and scrapers read them)."""

from __future__ import annotations

from checkflow_server.api.deps import CoordinatorDep
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from checkflow.protocol import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The coordinator is up")
async def healthz(coordinator: CoordinatorDep) -> Health:
    return coordinator.health()


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    summary="Prometheus text format",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(coordinator: CoordinatorDep) -> PlainTextResponse:
    text = coordinator.render_metrics()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
