"""Rules for jobs: creation (or the existing job of that name), resizing, roll-back."""

from __future__ import annotations

from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.errors import Conflict
from checkflow_server.domain.generation import new_generation
from checkflow_server.domain.state import Job, RankTable
from checkflow_server.domain.tuning import same_setting, schedule_for
from checkflow_server.domain.views import restore_point

from checkflow.protocol import CheckpointStatus, JobCreate, RecoverRequest, RestorePoint


def create_job(body: JobCreate, now: float, warmup_interval: int) -> tuple[Job, Changes]:
    """A new job in generation 1, checkpointing every ``body.every`` steps (fixed), or
    (``every="auto"``) every ``warmup_interval`` steps until the ranks have reported what a
    checkpoint costs."""
    job = Job(
        id=0,
        name=body.name,
        storage_uri=body.storage_uri,
        world_size=body.world_size,
        max_overhead=body.max_overhead,
        heartbeat_timeout_s=body.heartbeat_timeout_s,
        hang_timeout_s=body.hang_timeout_s,
        created=now,
        generation=1,
        generation_started=now,
        schedule=schedule_for(body.every, warmup_interval),
    )
    # Rank rows are written when ranks register: creating a big job stays cheap.
    changes = Changes(created=True)
    changes.event(job, EventKind.JOB_CREATED, now, None, {"world_size": body.world_size})
    return job, changes


def reopen_job(job: Job, body: JobCreate, now: float, warmup_interval: int) -> Changes:
    """A create request for an existing job: the job keeps its settings but two, the ranks'
    own. Their ``every`` (restarted with another one: the job shows what they apply), and a
    different world size (the job restarted elastically), which starts a new generation
    with fresh ranks."""
    changes = Changes()
    if not same_setting(job.schedule, body.every):
        job.schedule = schedule_for(body.every, warmup_interval).counted_from(job.max_step)
        changes.job = True
    if job.world_size == body.world_size:
        return changes
    old = job.world_size
    job.world_size = body.world_size
    job.ranks = RankTable(body.world_size)
    changes.ranks_cleared = True
    detail = {"old_world_size": old, "world_size": body.world_size}
    changes.event(job, EventKind.RESIZED, now, None, detail)
    new_generation(job, now, f"world size changed from {old} to {body.world_size}", changes)
    return changes


def recover(job: Job, body: RecoverRequest, now: float) -> tuple[RestorePoint, Changes]:
    """Roll the job back to committed ``body.step`` (default: the newest) in a new
    generation. Newer committed checkpoints are abandoned so that the restore point is
    that step; alive ranks are told to abort on their next heartbeat.

    Raises:
        Conflict: ``body.step`` is not a committed checkpoint. 409, not 404: the URL names
            the job, which exists; the step in the body does not fit its state.
    """
    step = body.step
    if step is not None:
        ck = job.checkpoints.get(step)
        if ck is None or ck.status != CheckpointStatus.COMMITTED:
            state = "not found" if ck is None else ck.status
            raise Conflict(
                f"checkpoint {step} of job {job.name!r} is {state}: only a committed "
                "checkpoint can be restored"
            )
    changes = Changes()
    if step is not None:
        job.ram = {s: ranks for s, ranks in job.ram.items() if s <= step}
        job.jit = {s for s in job.jit if s <= step}
        for newer in job.checkpoints.values():
            if newer.step > step and newer.status == CheckpointStatus.COMMITTED:
                newer.status = CheckpointStatus.ABANDONED
                changes.checkpoint(newer)
    changes.event(job, EventKind.ROLLBACK_REQUESTED, now, None, {"step": step})
    new_generation(job, now, "rollback requested", changes)
    return restore_point(job), changes
