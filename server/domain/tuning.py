"""Rule for the checkpoint interval: one per job, from its ranks' reports and the policy
shared with the runtime (:mod:`checkflow.policy`)."""

from __future__ import annotations

import math

from checkflow_server.domain import lifecycle
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import Job

from checkflow.policy import Profile, choose_interval


def retune(job: Job, now: float) -> Changes:
    """Recompute the job's interval; a change starts far enough ahead that every live rank
    hears of it before getting there (the previous schedule applies until then)."""
    changes = Changes()
    if job.state in lifecycle.ENDED:
        return changes  # it trains no more: its last measurements tune nothing
    t = job.ranks
    # Every rank must have reported: the slowest one sets the pace of synchronous training
    # and of its checkpoints, and it may be one not heard from yet. A change decided from
    # part of the ranks would also hold until the ranks reach its anchor.
    if min(t.iteration_s, default=-1.0) < 0 or min(t.stall_s, default=-1.0) < 0:
        return changes
    iteration = max(t.iteration_s)
    cost = max(t.stall_s)
    if iteration <= 0:
        return changes
    old = job.schedule
    if old.previous_anchor is not None and job.max_step < old.anchor:
        return changes  # the previous change has not taken effect everywhere yet
    persist = max(0.0, max(t.persist_s))
    mtbf = (now - job.created) / job.failures if job.failures else None
    profile = Profile(iteration_s=iteration, cost_s=cost, persist_s=persist)
    new = choose_interval(profile, max_overhead=job.max_overhead, mtbf_s=mtbf)
    if new == old.interval:
        return changes
    lead = math.ceil(job.heartbeat_timeout_s / iteration) + 1
    anchor = old.first_at_or_after(job.max_step + lead)
    job.schedule = old.changed_to(new, anchor=anchor)
    changes.job = True
    detail = {
        "old_interval": old.interval,
        "interval": new,
        "from_step": anchor,
        "iteration_s": iteration,
        "cost_s": cost,
        "persist_s": persist,
        "mtbf_s": mtbf,
        "max_overhead": job.max_overhead,
    }
    changes.event(job, EventKind.INTERVAL_CHANGED, now, None, detail)
    return changes
