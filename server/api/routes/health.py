"""Liveness and Prometheus metrics (no token: probes and scrapers read them)."""

from __future__ import annotations

from checkflow_server.api.deps import CoordinatorDep
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from checkflow.protocol import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The coordinator is up")
async def healthz(coordinator: CoordinatorDep) -> Health:
    return coordinator.health()


EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    summary="Prometheus text format",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(coordinator: CoordinatorDep) -> PlainTextResponse:
    return PlainTextResponse(coordinator.render_metrics(), media_type=EXPOSITION)


# Uptime probes and some scrapers check a target with HEAD first, and a 405 there reads as
# "the coordinator is down". The same status and content type as GET, with no body to render.
@router.head("/metrics", response_class=Response, summary="GET /metrics without its body")
async def metrics_head() -> Response:
    return Response(media_type=EXPOSITION)
