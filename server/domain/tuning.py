"""Rules for the checkpoint interval: one per job, from its ranks' reports and the policy
shared with the runtime (:mod:`checkflow.interval`).

A fixed ``every=N`` is the ranks' own: it is shown as it is and never recomputed. With
``every="auto"`` the coordinator computes one interval for the whole job; the ranks count
it from their newest checkpoint and adopt a new one at their next checkpoint at the latest,
so the schedule here counts from the newest checkpoint step reported (:func:`reached`).
"""

from __future__ import annotations

from checkflow_server.domain import lifecycle
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import Job

from checkflow.interval import Profile, choose_interval
from checkflow.protocol import IntervalMode, Schedule


def schedule_for(every: int | None, warmup_interval: int) -> Schedule:
    """A job's schedule from its ranks' setting: their fixed ``every``, or (None,
    ``every="auto"``) the warm-up interval until the coordinator has measurements."""
    if every is not None:
        return Schedule(anchor=0, interval=every, mode=IntervalMode.FIXED)
    return Schedule(anchor=0, interval=warmup_interval, mode=IntervalMode.WARMUP)


def same_setting(schedule: Schedule, every: int | None) -> bool:
    """Whether ``schedule`` is what ranks with ``every`` (None: ``"auto"``) apply."""
    if schedule.mode == IntervalMode.FIXED:
        return every == schedule.interval
    return every is None


def reached(job: Job, step: int) -> bool:
    """The job reached checkpoint ``step`` (a rank reported its part or its commit): it
    counts as the job's furthest step, and ``every="auto"`` counts the interval from it, as
    the ranks do (they count from their newest checkpoint). True when the schedule moved
    (the job's row is to be written)."""
    job.max_step = max(job.max_step, step)
    counted = job.schedule.counted_from(step)
    if counted == job.schedule:
        return False
    job.schedule = counted
    return True


def retune(job: Job, now: float) -> Changes:
    """Recompute the interval of an ``every="auto"`` job from every rank's measurements.

    The change applies at once here, counted from the newest checkpoint: the ranks adopt it
    at their next checkpoint at the latest. Waiting for a step far ahead instead kept a job
    of short steps on the warm-up interval for its whole run.
    """
    changes = Changes()
    if job.state in lifecycle.ENDED:
        return changes  # it trains no more: its last measurements tune nothing
    old = job.schedule
    if old.mode == IntervalMode.FIXED:
        return changes
    t = job.ranks
    # Every rank must have reported: the slowest one sets the pace of synchronous training
    # and of its checkpoints, and it may be one not heard from yet.
    if min(t.iteration_s, default=-1.0) < 0 or min(t.stall_s, default=-1.0) < 0:
        return changes
    iteration = max(t.iteration_s)
    cost = max(t.stall_s)
    if iteration <= 0:
        return changes
    persist = max(0.0, max(t.persist_s))
    mtbf = (now - job.created) / job.failures if job.failures else None
    profile = Profile(iteration_s=iteration, cost_s=cost, persist_s=persist)
    new = choose_interval(profile, max_overhead=job.max_overhead, mtbf_s=mtbf)
    if new == old.interval and old.mode == IntervalMode.TUNED:
        return changes
    job.schedule = old.model_copy(update={"interval": new, "mode": IntervalMode.TUNED})
    changes.job = True
    detail = {
        "old_interval": old.interval,
        "interval": new,
        "from_step": old.next_after(job.max_step),
        "iteration_s": iteration,
        "cost_s": cost,
        "persist_s": persist,
        "mtbf_s": mtbf,
        "max_overhead": job.max_overhead,
    }
    changes.event(job, EventKind.INTERVAL_CHANGED, now, None, detail)
    return changes
