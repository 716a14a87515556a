"""Checkpoints: per-rank persist reports, commits, listing."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api.convert import checkpoint_public
from checkflow_server.api.deps import CoordinatorDep
from fastapi import APIRouter, Path, Query

from checkflow.protocol import (
    MAX_INT,
    CheckpointList,
    CheckpointPublic,
    CommitReport,
    PartReply,
    PartReport,
)

router = APIRouter(prefix="/jobs/{job}/checkpoints", tags=["checkpoints"])

StepPath = Annotated[int, Path(ge=0, le=MAX_INT, description="Checkpoint step.")]
RankPath = Annotated[int, Path(ge=0, le=2**31)]


@router.put("/{step}/ranks/{rank}", summary="A rank persisted its part of a checkpoint")
async def report_part(
    job: str, step: StepPath, rank: RankPath, body: PartReport, coordinator: CoordinatorDep
) -> PartReply:
    ck, must_commit = coordinator.report_part(
        job,
        step,
        rank,
        generation=body.generation,
        nbytes=body.nbytes,
        duration_s=body.duration_s,
        manifest_path=body.manifest_path,
    )
    return PartReply(
        step=step,
        status=ck.status,
        persisted_ranks=ck.persisted,
        world_size=coordinator.job(job).world_size,
        must_commit=must_commit,
    )


@router.post("/{step}/commit", summary="The global manifest of a checkpoint is written")
async def commit(
    job: str, step: StepPath, body: CommitReport, coordinator: CoordinatorDep
) -> CheckpointPublic:
    ck = coordinator.commit(job, step, body.rank)
    return checkpoint_public(coordinator.job(job), ck)


@router.get("", summary="Checkpoints of the job, newest first")
async def list_checkpoints(
    job: str,
    coordinator: CoordinatorDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> CheckpointList:
    j = coordinator.job(job)
    newest = sorted(j.checkpoints, reverse=True)[:limit]
    return CheckpointList(checkpoints=[checkpoint_public(j, j.checkpoints[s]) for s in newest])
