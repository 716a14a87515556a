"""Rules for jobs: creation (or the existing job of that name), resizing, roll-back, and
the stop a launcher reports."""

from __future__ import annotations

from checkflow_server.domain import lifecycle
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.errors import Conflict
from checkflow_server.domain.generation import new_generation
from checkflow_server.domain.state import Job, RankTable
from checkflow_server.domain.tuning import same_setting, schedule_for
from checkflow_server.domain.views import job_public, restore_point

from checkflow.protocol import (
    CheckpointStatus,
    JobCreate,
    JobPublic,
    RankState,
    RecoverRequest,
    RestorePoint,
    StopRequest,
)


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
    generation; alive ranks are told to abort on their next heartbeat.

    The committed checkpoints above the step are abandoned only once the job leaves their
    timeline: at once for a live job (its ranks abort and train again from the step,
    over those steps), and for an ended one (finished, stopped, failed) when it is
    launched again (:func:`settle_rollback`). Until then they stay committed, as storage
    holds them, and the restore point is the step (:attr:`Job.rollback_step`).

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
        job.rollback_step = step
        if job.state not in lifecycle.ENDED:
            settle_rollback(job, changes)
    changes.event(job, EventKind.ROLLBACK_REQUESTED, now, None, {"step": step})
    new_generation(job, now, "rollback requested", changes)
    return restore_point(job), changes


def settle_rollback(job: Job, changes: Changes) -> None:
    """The job leaves the timeline past its pending roll-back (its ranks train from the
    step again, writing those steps anew): the committed checkpoints above the step are
    abandoned, for good."""
    step = job.rollback_step
    if step is None:
        return
    job.rollback_step = None
    changes.job = True
    for newer in job.checkpoints.values():
        if newer.step > step and newer.status == CheckpointStatus.COMMITTED:
            newer.status = CheckpointStatus.ABANDONED
            changes.checkpoint(newer)


def stop(job: Job, body: StopRequest, now: float) -> tuple[JobPublic, Changes]:
    """The job's launcher stopped (``body.reason``): the job is stopped or failed, and its
    alive ranks are no longer watched (their silence from now on is the stop, not a
    failure to recover from).

    Fenced like a heartbeat: a generation the coordinator never issued is refused; one
    the job has left is taken only while no rank is alive in the current generation (a
    launcher that saw an older view, e.g. after its last crash report started a new
    generation), so that a stale launcher never stops a job that another one runs.

    Raises:
        Conflict: a generation newer than the job's, or an older one while ranks of the
            current generation are alive.
    """
    g = job.generation
    if body.generation > g or (body.generation < g and job.alive_ranks() > 0):
        raise Conflict(
            f"generation {body.generation} is not job {job.name!r}'s current generation {g}"
            + (f" (ranks alive in generation {g})" if body.generation < g else "")
        )
    changes = Changes()
    state = lifecycle.on_stopped(job.state, body.reason)
    if state == job.state:
        return job_public(job), changes
    t = job.ranks
    for r in range(job.world_size):
        if t.state[r] == RankState.ALIVE:
            t.unwatch(r, RankState.ABORTED)
            changes.rank(r)
    job.state, changes.job = state, True
    detail = {"reason": body.reason, "state": state, "detail": body.detail}
    changes.event(job, EventKind.STOPPED, now, None, detail)
    return job_public(job), changes
