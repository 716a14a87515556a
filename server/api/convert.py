"""Internal state -> response models."""

from __future__ import annotations

import time

from checkflow_server.state import ALIVE, Checkpoint, Job

from checkflow.protocol import CheckpointPublic, JobPublic, RankPublic, Schedule


def schedule_of(job: Job) -> Schedule:
    s = job.schedule
    return Schedule(
        anchor=s.anchor,
        interval=s.interval,
        previous_anchor=s.prev_anchor,
        previous_interval=s.prev_interval,
    )


def job_public(job: Job) -> JobPublic:
    return JobPublic(
        name=job.name,
        world_size=job.world_size,
        storage_uri=job.storage_uri,
        max_overhead=job.max_overhead,
        heartbeat_timeout_s=job.heartbeat_timeout_s,
        created=job.created,
        generation=job.generation,
        interval=job.interval,
        next_checkpoint_step=job.next_checkpoint_step(),
        schedule=schedule_of(job),
        restore_step=job.restore_step(),
        ranks_alive=job.alive_ranks(),
        failures=job.failures,
        recovering=job.recovering_since is not None,
    )


def rank_public(job: Job, rank: int) -> RankPublic:
    row = job.ranks.row(rank)
    last = row["last_heartbeat"]
    return RankPublic(
        rank=rank,
        generation=row["generation"],
        state=row["state"],
        alive=row["state"] == ALIVE and row["generation"] == job.generation,
        step=row["step"],
        node=row["node"],
        last_heartbeat=last,
        seconds_since_heartbeat=None if last is None else max(0.0, time.time() - last),
        iteration_s=row["iteration_s"],
        stall_s=row["stall_s"],
        persist_s=row["persist_s"],
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
    )
