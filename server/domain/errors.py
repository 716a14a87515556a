"""Refusals of the rules; the API turns them into HTTP statuses."""

from __future__ import annotations


class NotFound(LookupError):
    """Unknown job, rank or step (HTTP 404)."""


class Conflict(RuntimeError):
    """The request contradicts the job's state, e.g. a stale generation (HTTP 409)."""
