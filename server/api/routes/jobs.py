"""Jobs: create or look up, restore point, roll back, events."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api.deps import CoordinatorDep, PrincipalDep
from checkflow_server.api.strict_json import StrictJSONRoute
from checkflow_server.domain.changes import EventKind
from fastapi import APIRouter, HTTPException, Query, Request, Response

from checkflow.protocol import (
    MAX_INT,
    EventList,
    JobCreate,
    JobCreated,
    JobList,
    JobPublic,
    RecoverRequest,
    RestorePoint,
    StopRequest,
    paths,
)

router = APIRouter(tags=["jobs"], route_class=StrictJSONRoute)


@router.post(
    paths.JOBS,
    responses={201: {"model": JobCreated, "description": "Created"}},
    summary="Create a job, or return the one with this name",
)
async def create_job(
    body: JobCreate,
    coordinator: CoordinatorDep,
    principal: PrincipalDep,
    request: Request,
    response: Response,
) -> JobCreated:
    """With the admin token, a job created now comes with its first job token (in
    ``token``, this once). A job token may create or re-open only its own job."""
    if principal.job is not None and body.name != principal.job:
        raise HTTPException(
            403, f"this token belongs to job {principal.job!r}: it cannot create job {body.name!r}"
        )
    job, created = coordinator.create_job(body)
    token = None
    if created:
        response.status_code = 201
        if job.storage_uri:
            request.app.state.storage_sync.schedule(job.name)
        if principal.kind == "admin":
            token = request.app.state.tokens.issue(job.name)
    return JobCreated(**job.model_dump(), token=token)


@router.get(paths.JOBS, summary="List jobs")
async def list_jobs(coordinator: CoordinatorDep) -> JobList:
    return coordinator.list_jobs()


@router.get(paths.JOB, summary="One job")
async def get_job(job: str, coordinator: CoordinatorDep) -> JobPublic:
    return coordinator.get_job(job)


@router.get(paths.RESTORE_POINT, summary="The newest checkpoint every rank committed")
async def restore_point(job: str, coordinator: CoordinatorDep) -> RestorePoint:
    return coordinator.restore_point(job)


@router.post(paths.RECOVER, summary="Roll the job back to a committed checkpoint (new generation)")
async def recover(job: str, body: RecoverRequest, coordinator: CoordinatorDep) -> RestorePoint:
    return coordinator.recover(job, body)


@router.post(paths.STOP, summary="A launcher stopped the job (Ctrl-C, or it gave up recovering)")
async def stop(job: str, body: StopRequest, coordinator: CoordinatorDep) -> JobPublic:
    """Idempotent: a job that has ended already stays as it ended (200)."""
    return coordinator.stop(job, body)


@router.get(paths.EVENTS, summary="Failures, recoveries and interval changes")
async def events(
    job: str,
    coordinator: CoordinatorDep,
    after: Annotated[int, Query(ge=0, le=MAX_INT, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    kind: Annotated[
        list[EventKind] | None,
        # Named kinds only: an unknown or empty one is a 422, not an empty answer.
        Query(max_length=16, description="Only events of these kinds (repeatable)."),
    ] = None,
) -> EventList:
    """The newest ``limit`` events (of the kinds asked, before the limit counts)."""
    return coordinator.events(job, after=after, limit=limit, kinds=kind or ())
