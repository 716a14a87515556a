"""Refusals of the rules; the API turns them into HTTP statuses."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from checkflow_server.domain.changes import Changes


class NotFound(LookupError):
    """Unknown job, rank or step (HTTP 404)."""


class Conflict(RuntimeError):
    """The request contradicts the job's state, e.g. a stale generation (HTTP 409)."""


class StaleGeneration(Conflict):
    """A report from a generation the job has left (HTTP 409). ``changes`` holds the one
    fact such a report proves, that its rank heard of the new generation (state
    ``aborted``); nothing it reports is recorded."""

    def __init__(self, message: str, changes: Changes) -> None:
        super().__init__(message)
        self.changes = changes


class Elsewhere(LookupError):
    """The job is served by another replica, at ``url`` (HTTP 307 there)."""

    def __init__(self, url: str) -> None:
        super().__init__(f"the job is served by {url}")
        self.url = url


class Unavailable(RuntimeError):
    """The database cannot be reached: nothing was written (HTTP 503; retry later)."""
