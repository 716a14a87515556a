"""The job's state as the protocol's public models (what the API shows)."""

from __future__ import annotations

from typing import Any

from checkflow_server.domain.state import Checkpoint, Job

from checkflow.protocol import (
    CheckpointPublic,
    JobPublic,
    JobState,
    RankPublic,
    Registration,
    RestorePoint,
)


def schedule_fields(job: Job) -> dict[str, Any]:
    """What every registration and heartbeat reply tells a rank about the schedule."""
    return {
        "generation": job.generation,
        "interval": job.interval,
        "next_checkpoint_step": job.next_checkpoint_step(),
        "schedule": job.schedule,
    }


def registration(job: Job) -> Registration:
    return Registration(restore_step=job.restore_step(), **schedule_fields(job))


def restore_point(job: Job) -> RestorePoint:
    return RestorePoint(generation=job.generation, step=job.restore_step())


def job_public(job: Job) -> JobPublic:
    return JobPublic(
        name=job.name,
        world_size=job.world_size,
        storage_uri=job.storage_uri,
        max_overhead=job.max_overhead,
        heartbeat_timeout_s=job.heartbeat_timeout_s,
        hang_timeout_s=job.hang_timeout_s,
        created=job.created,
        restore_step=job.restore_step(),
        ranks_alive=job.alive_ranks(),
        failures=job.failures,
        recovering=job.state == JobState.RECOVERING,
        state=job.state,
        **schedule_fields(job),
    )


def rank_public(job: Job, rank: int, now: float) -> RankPublic:
    t = job.ranks
    last = t.last_heartbeat[rank]
    return RankPublic(
        rank=rank,
        generation=t.generation[rank],
        state=t.state[rank],
        alive=job.is_alive(rank),
        step=t.step[rank],
        node=t.node[rank],
        last_heartbeat=last,
        seconds_since_heartbeat=None if last is None else max(0.0, now - last),
        iteration_s=measured(t.iteration_s[rank]),
        stall_s=measured(t.stall_s[rank]),
        persist_s=measured(t.persist_s[rank]),
    )


def checkpoint_public(job: Job, ck: Checkpoint) -> CheckpointPublic:
    return CheckpointPublic(
        step=ck.step,
        status=ck.status,
        generation=ck.generation,
        persisted_ranks=ck.persisted,
        world_size=job.world_size,
        nbytes=ck.nbytes,
        started=ck.started,
        committed_at=ck.committed_at,
        committer=ck.committer,
        source=ck.source,
        kind=ck.kind,
    )


def measured(value: float) -> float | None:
    """A measurement as shown and stored: None when not reported yet."""
    return None if value < 0 else value
