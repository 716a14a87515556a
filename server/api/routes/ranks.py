"""Ranks: register, heartbeat (one rank or one node), finish, list."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api.deps import CoordinatorDep
from checkflow_server.api.strict_json import StrictJSONRoute
from fastapi import APIRouter, Path, Request

from checkflow.protocol import (
    MAX_NODE_NAME,
    MAX_RANK,
    FailureReport,
    FinishRequest,
    Heartbeat,
    HeartbeatReply,
    NodeHeartbeat,
    NodeHeartbeatReply,
    RankList,
    RankPublic,
    RegisterRequest,
    Registration,
    paths,
)

router = APIRouter(tags=["ranks"], route_class=StrictJSONRoute)

RankPath = Annotated[int, Path(ge=0, le=MAX_RANK, description="Rank in the job.")]
NodePath = Annotated[
    str, Path(min_length=1, max_length=MAX_NODE_NAME, description="Node (host) name.")
]


@router.post(paths.REGISTER, summary="Register a (re)started rank")
async def register(
    job: str, rank: RankPath, body: RegisterRequest, coordinator: CoordinatorDep, request: Request
) -> Registration:
    # The restore point must include commits whose report never arrived (see storage_sync).
    await request.app.state.storage_sync.before_registration(job)
    return coordinator.register(job, rank, body)


@router.post(paths.RANK_HEARTBEAT, summary="One rank's heartbeat")
async def heartbeat(
    job: str, rank: RankPath, body: Heartbeat, coordinator: CoordinatorDep
) -> HeartbeatReply:
    return coordinator.rank_heartbeat(job, rank, body)


@router.post(paths.NODE_HEARTBEAT, summary="One heartbeat carrying a node's local ranks")
async def node_heartbeat(
    job: str, node: NodePath, body: NodeHeartbeat, coordinator: CoordinatorDep
) -> NodeHeartbeatReply:
    return coordinator.node_heartbeat(job, node, body)


@router.post(paths.FINISH, summary="A rank ended training normally")
async def finish(
    job: str, rank: RankPath, body: FinishRequest, coordinator: CoordinatorDep
) -> RankPublic:
    return coordinator.finish(job, rank, body)


@router.post(
    paths.FAILURE,
    summary="A launcher saw a rank's process fail: declare it failed now (kind crash)",
)
async def failure(
    job: str, rank: RankPath, body: FailureReport, coordinator: CoordinatorDep
) -> RankPublic:
    """Idempotent: a rank no longer alive in ``body.generation`` is left as it is (200)."""
    return coordinator.report_failure(job, rank, body)


@router.get(paths.RANKS, summary="Every rank of the job")
async def list_ranks(job: str, coordinator: CoordinatorDep) -> RankList:
    return coordinator.list_ranks(job)
