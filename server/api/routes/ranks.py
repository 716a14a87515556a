"""Ranks: register, heartbeat (one rank or one node), list."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api.convert import rank_public, schedule_of
from checkflow_server.api.deps import CoordinatorDep
from checkflow_server.coordinator import RankReport
from fastapi import APIRouter, Path

from checkflow.protocol import (
    FinishRequest,
    Heartbeat,
    HeartbeatReply,
    NodeHeartbeat,
    NodeHeartbeatReply,
    RankAction,
    RankList,
    RankPublic,
    RegisterRequest,
    Registration,
)

router = APIRouter(prefix="/jobs/{job}", tags=["ranks"])

RankPath = Annotated[int, Path(ge=0, le=2**31, description="Rank in the job.")]
NodePath = Annotated[str, Path(min_length=1, max_length=256, description="Node (host) name.")]


@router.post("/ranks/{rank}/register", summary="Register a (re)started rank")
async def register(
    job: str, rank: RankPath, body: RegisterRequest, coordinator: CoordinatorDep
) -> Registration:
    j = coordinator.register(job, rank, instance=body.instance, node=body.node)
    return Registration(
        generation=j.generation,
        restore_step=j.restore_step(),
        interval=j.interval,
        next_checkpoint_step=j.next_checkpoint_step(),
        schedule=schedule_of(j),
    )


@router.post("/ranks/{rank}/heartbeat", summary="One rank's heartbeat")
async def heartbeat(
    job: str, rank: RankPath, body: Heartbeat, coordinator: CoordinatorDep
) -> HeartbeatReply:
    report = RankReport(
        rank, body.generation, body.step, body.iteration_s, body.stall_s, body.persist_s
    )
    j, (action,) = coordinator.heartbeat(job, [report])
    return HeartbeatReply(
        action=action,
        generation=j.generation,
        interval=j.interval,
        next_checkpoint_step=j.next_checkpoint_step(),
        schedule=schedule_of(j),
    )


@router.post("/nodes/{node}/heartbeat", summary="One heartbeat carrying a node's local ranks")
async def node_heartbeat(
    job: str, node: NodePath, body: NodeHeartbeat, coordinator: CoordinatorDep
) -> NodeHeartbeatReply:
    reports = [
        RankReport(r.rank, r.generation, r.step, r.iteration_s, r.stall_s, r.persist_s)
        for r in body.ranks
    ]
    j, actions = coordinator.heartbeat(job, reports, node=node)
    return NodeHeartbeatReply(
        generation=j.generation,
        interval=j.interval,
        next_checkpoint_step=j.next_checkpoint_step(),
        schedule=schedule_of(j),
        ranks=[RankAction(rank=r.rank, action=a) for r, a in zip(reports, actions, strict=True)],
    )


@router.post("/ranks/{rank}/finish", summary="A rank ended training normally")
async def finish(
    job: str, rank: RankPath, body: FinishRequest, coordinator: CoordinatorDep
) -> RankPublic:
    j = coordinator.finish(job, rank, body.generation, body.step)
    return rank_public(j, rank)


@router.get("/ranks", summary="Every rank of the job")
async def list_ranks(job: str, coordinator: CoordinatorDep) -> RankList:
    j = coordinator.job(job)
    return RankList(ranks=[rank_public(j, r) for r in range(j.world_size)])
