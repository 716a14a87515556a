"""Jobs: create or look up, restore point, roll back, events."""

from __future__ import annotations

import asyncio
from typing import Annotated

from checkflow_server.api.convert import job_public
from checkflow_server.api.deps import CoordinatorDep
from checkflow_server.coordinator import JobSpec
from fastapi import APIRouter, Query, Request, Response

from checkflow.protocol import (
    MAX_INT,
    EventList,
    EventPublic,
    JobCreate,
    JobList,
    JobPublic,
    RecoverRequest,
    RestorePoint,
)

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post(
    "",
    responses={201: {"model": JobPublic, "description": "Created"}},
    summary="Create a job, or return the one with this name",
)
async def create_job(
    body: JobCreate, coordinator: CoordinatorDep, request: Request, response: Response
) -> JobPublic:
    job, created = coordinator.create_job(JobSpec(**body.model_dump()))
    if created:
        response.status_code = 201
        sync = request.app.state.storage_sync
        if job.storage_uri and sync is not None:
            request.app.state.background.add(asyncio.create_task(sync(job.name)))
    return job_public(job)


@router.get("", summary="List jobs")
async def list_jobs(coordinator: CoordinatorDep) -> JobList:
    return JobList(jobs=[job_public(j) for j in coordinator.jobs.values()])


@router.get("/{job}", summary="One job")
async def get_job(job: str, coordinator: CoordinatorDep) -> JobPublic:
    return job_public(coordinator.job(job))


@router.get("/{job}/restore-point", summary="The newest checkpoint every rank committed")
async def restore_point(job: str, coordinator: CoordinatorDep) -> RestorePoint:
    j = coordinator.job(job)
    return RestorePoint(generation=j.generation, step=j.restore_step())


@router.post(
    "/{job}/recover",
    summary="Roll the job back to a committed checkpoint (new generation)",
)
async def recover(job: str, body: RecoverRequest, coordinator: CoordinatorDep) -> RestorePoint:
    j = coordinator.recover(job, body.step)
    return RestorePoint(generation=j.generation, step=j.restore_step())


@router.get("/{job}/events", summary="Failures, recoveries and interval changes")
async def events(
    job: str,
    coordinator: CoordinatorDep,
    after: Annotated[int, Query(ge=0, le=MAX_INT, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> EventList:
    j = coordinator.job(job)
    rows = coordinator.store.events(j.id, after=after, limit=limit)
    return EventList(events=[EventPublic(**row) for row in rows])
