"""The mapping between rows and the domain's objects, in one place.

Adding a column means: a migration (``migrations/versions``), its line in
:mod:`.schema`, its key in the ``*_row`` function and its read in the ``*_from_row`` (or
``load_rank``) function below. Statements are built from the rows' keys, so no other list
of columns exists.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from checkflow_server.domain import lifecycle
from checkflow_server.domain.changes import Event, EventKind
from checkflow_server.domain.state import UNKNOWN, Checkpoint, Job, Part, RankTable, Recovery
from checkflow_server.domain.views import measured
from sqlalchemy import RowMapping

from checkflow.protocol import (
    CheckpointKind,
    CheckpointSource,
    CheckpointStatus,
    EventPublic,
    IntervalMode,
    RankState,
    Schedule,
)

Row = RowMapping
"""A row as the repository reads it."""

HEARTBEAT_COLUMNS = ("last_heartbeat", "step", "iteration_s", "stall_s", "persist_s", "node")
"""The rank columns a heartbeat changes: the hot path updates only these, with the values
of :func:`heartbeat_row` (a tuple, not a dict: this runs for every rank every second)."""


# --- jobs -----------------------------------------------------------------------------
def job_row(job: Job) -> dict[str, Any]:
    s = job.schedule
    return {
        "id": job.id,
        "name": job.name,
        "storage_uri": job.storage_uri,
        "world_size": job.world_size,
        "max_overhead": job.max_overhead,
        "heartbeat_timeout_s": job.heartbeat_timeout_s,
        "created": job.created,
        "generation": job.generation,
        "generation_started": job.generation_started,
        "recovering_since": job.recovering_since,
        "interval": s.interval,
        "anchor": s.anchor,
        "interval_mode": s.mode,
        "max_step": job.max_step,
        "failures": job.failures,
        "hang_timeout_s": job.hang_timeout_s,
        "state": job.state,
        "rollback_step": job.rollback_step,
    }


def job_from_row(row: Row) -> Job:
    # An older coordinator's row has no mode: it tuned every job, so it is every="auto".
    mode = row["interval_mode"] or IntervalMode.WARMUP
    schedule = Schedule(anchor=row["anchor"], interval=row["interval"], mode=mode)
    return Job(
        id=row["id"],
        name=row["name"],
        storage_uri=row["storage_uri"],
        world_size=row["world_size"],
        max_overhead=row["max_overhead"],
        heartbeat_timeout_s=row["heartbeat_timeout_s"],
        created=row["created"],
        generation=row["generation"],
        generation_started=row["generation_started"],
        schedule=schedule,
        max_step=row["max_step"],
        failures=row["failures"],
        recovering_since=row["recovering_since"],
        hang_timeout_s=row["hang_timeout_s"],
        state=lifecycle.from_stored(row["state"], row["recovering_since"] is not None),
        rollback_step=row["rollback_step"],
    )


def recovery_from_events(job: Job, events: Sequence[Row]) -> Recovery | None:
    """The recovery still pending in the job's current generation, from its
    ``generation_started`` and ``trained_again`` events (oldest first): the recovery
    is not a column of its own because these events already say everything about it."""
    pending = None
    for row in events:
        if row["kind"] == EventKind.TRAINED_AGAIN:
            pending = None
        elif row["kind"] == EventKind.GENERATION_STARTED and row["generation"] == job.generation:
            d = json.loads(row["detail"])
            kind, ranks = d.get("kind"), d.get("failed_ranks") or ""
            pending = Recovery(row["time"], kind, d.get("detection_s"), str(ranks))
    return pending


# --- ranks ----------------------------------------------------------------------------
def rank_row(job_id: int, t: RankTable, rank: int) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "rank": rank,
        "generation": t.generation[rank],
        "state": t.state[rank],
        "instance": t.instance[rank],
        "node": t.node[rank],
        "registered_at": t.registered_at[rank],
        "last_heartbeat": t.last_heartbeat[rank],
        "step": t.step[rank],
        "iteration_s": measured(t.iteration_s[rank]),
        "stall_s": measured(t.stall_s[rank]),
        "persist_s": measured(t.persist_s[rank]),
    }


def heartbeat_row(job_id: int, t: RankTable, rank: int) -> tuple[object, ...]:
    """The values of :data:`HEARTBEAT_COLUMNS` as :func:`rank_row` maps them, then the key
    (job_id, rank)."""
    return (
        t.last_heartbeat[rank],
        t.step[rank],
        measured(t.iteration_s[rank]),
        measured(t.stall_s[rank]),
        measured(t.persist_s[rank]),
        t.node[rank],
        job_id,
        rank,
    )


def load_rank(t: RankTable, row: Row) -> None:
    r = row["rank"]
    t.generation[r] = row["generation"]
    t.state[r] = RankState(row["state"])
    t.instance[r] = row["instance"]
    t.node[r] = row["node"]
    t.registered_at[r] = row["registered_at"]
    t.last_heartbeat[r] = row["last_heartbeat"]
    t.step[r] = row["step"] or 0
    t.iteration_s[r] = _unknown(row["iteration_s"])
    t.stall_s[r] = _unknown(row["stall_s"])
    t.persist_s[r] = _unknown(row["persist_s"])


# --- checkpoints and their parts ------------------------------------------------------
def checkpoint_row(job_id: int, ck: Checkpoint) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "step": ck.step,
        "generation": ck.generation,
        "status": ck.status,
        "started": ck.started,
        "committed_at": ck.committed_at,
        "committer": ck.committer,
        "nbytes": ck.nbytes,
        "source": ck.source,
        "persisted": ck.persisted,
        "kind": ck.kind,
    }


def checkpoint_from_row(row: Row) -> Checkpoint:
    return Checkpoint(
        step=row["step"],
        generation=row["generation"],
        status=CheckpointStatus(row["status"]),
        started=row["started"],
        committed_at=row["committed_at"],
        committer=row["committer"],
        nbytes=row["nbytes"],
        source=CheckpointSource(row["source"]),
        persisted=row["persisted"],
        kind=CheckpointKind(row["kind"]) if row["kind"] else None,
    )


def part_row(job_id: int, step: int, part: Part) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "step": step,
        "rank": part.rank,
        "nbytes": part.nbytes,
        "duration_s": part.duration_s,
        "manifest_path": part.manifest_path,
        "reported_at": part.reported_at,
    }


def part_from_row(row: Row) -> Part:
    return Part(
        rank=row["rank"],
        nbytes=row["nbytes"],
        duration_s=row["duration_s"],
        manifest_path=row["manifest_path"],
        reported_at=row["reported_at"],
    )


# --- events ---------------------------------------------------------------------------
def event_row(job_id: int, event: Event) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "time": event.time,
        "kind": event.kind,
        "generation": event.generation,
        "rank": event.rank,
        "detail": json.dumps(event.detail),
    }


def event_from_row(row: Row) -> EventPublic:
    return EventPublic(
        id=row["id"],
        time=row["time"],
        kind=row["kind"],
        generation=row["generation"],
        rank=row["rank"],
        detail=json.loads(row["detail"]),
    )


def _unknown(value: float | None) -> float:
    return UNKNOWN if value is None else value
