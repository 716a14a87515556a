"""Job tokens: a new one for a job, with the admin token only (``api/auth.py``)."""

from __future__ import annotations

from typing import Annotated

from checkflow_server.api.strict_json import StrictJSONRoute
from fastapi import APIRouter, Path, Request, Response

from checkflow.protocol import JobToken, paths
from checkflow.protocol.fields import JobName

router = APIRouter(tags=["jobs"], route_class=StrictJSONRoute)


@router.post(
    paths.JOB_TOKENS,
    status_code=201,
    summary="Issue a token that acts on this job only (admin token only)",
)
async def issue_token(
    job: Annotated[JobName, Path(description="The job; it need not exist yet.")],
    request: Request,
    response: Response,
) -> JobToken:
    """A launcher trades the admin token for one of these before it starts its workers, so
    training processes never hold the admin token. The job need not exist yet: the ranks
    create it with this token. Each call issues another token; all stay valid."""
    response.headers["Cache-Control"] = "no-store"
    return JobToken(job=job, token=request.app.state.tokens.issue(job))
