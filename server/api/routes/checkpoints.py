"""Checkpoints: per-rank persist reports, commits, listing."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api.deps import CoordinatorDep
from checkflow_server.api.strict_json import StrictJSONRoute
from fastapi import APIRouter, Path, Query

from checkflow.protocol import (
    MAX_INT,
    MAX_RANK,
    CheckpointList,
    CheckpointPublic,
    CommitReport,
    JobPublic,
    PartReply,
    PartReport,
    RestoredReport,
    RestorePoint,
    RetentionReport,
    paths,
)

router = APIRouter(tags=["checkpoints"], route_class=StrictJSONRoute)

StepPath = Annotated[int, Path(ge=0, le=MAX_INT, description="Checkpoint step.")]
RankPath = Annotated[int, Path(ge=0, le=MAX_RANK)]


@router.put(paths.PART, summary="A rank persisted its part of a checkpoint")
async def report_part(
    job: str, step: StepPath, rank: RankPath, body: PartReport, coordinator: CoordinatorDep
) -> PartReply:
    return coordinator.report_part(job, step, rank, body)


@router.post(paths.COMMIT, summary="The global manifest of a checkpoint is written")
async def commit(
    job: str, step: StepPath, body: CommitReport, coordinator: CoordinatorDep
) -> CheckpointPublic:
    return coordinator.commit(job, step, body)


@router.post(
    paths.RESTORED,
    summary="A rank restored another step than advised: the restore point is corrected",
)
async def restored(
    job: str, rank: RankPath, body: RestoredReport, coordinator: CoordinatorDep
) -> RestorePoint:
    """Storage is the truth: committed steps above the one the rank could read go."""
    return coordinator.restored(job, rank, body)


@router.post(paths.RETENTION, summary="Deleting old checkpoints failed, or works again")
async def retention(
    job: str, rank: RankPath, body: RetentionReport, coordinator: CoordinatorDep
) -> JobPublic:
    """An event (``retention_failed`` / ``retention_ok``), counted in ``/metrics``."""
    return coordinator.retention(job, rank, body)


@router.get(paths.CHECKPOINTS, summary="Checkpoints of the job, newest first")
async def list_checkpoints(
    job: str,
    coordinator: CoordinatorDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> CheckpointList:
    return coordinator.list_checkpoints(job, limit=limit)
