"""Generations: how a job moves on after a failure, a resize or a roll-back.

A generation is one incarnation of the job's process group. When a rank fails, every rank
of the current generation must abort and the restarted group registers in the next one,
restoring the newest checkpoint that every rank committed.
"""

from __future__ import annotations

from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import Job

from checkflow.protocol import CheckpointStatus, RankState, Schedule


def new_generation(job: Job, now: float, reason: str, changes: Changes) -> None:
    """Start the job's next generation: in-flight checkpoints are abandoned, the schedule
    restarts from the restore point, and recovery lasts until every rank registered."""
    job.generation += 1
    job.generation_started = now
    job.recovering_since = now
    job.registered = 0
    for ck in job.checkpoints.values():
        if ck.status == CheckpointStatus.IN_PROGRESS:
            ck.status = CheckpointStatus.ABANDONED
            changes.checkpoint(ck)
    restore = job.restore_step()
    base = restore or 0
    job.schedule = Schedule(anchor=base + job.schedule.interval, interval=job.schedule.interval)
    job.max_step = base
    changes.job = True
    changes.event(
        job, EventKind.GENERATION_STARTED, now, None, {"reason": reason, "restore_step": restore}
    )


def declare_failed(job: Job, ranks: list[int], now: float, reason: str, changes: Changes) -> None:
    """``ranks`` failed; if one of them belongs to the current generation, the job moves
    to the next (its other ranks learn it from their next heartbeat reply: abort)."""
    t = job.ranks
    current = False
    for r in ranks:
        last = t.last_heartbeat[r]
        t.unwatch(r, RankState.FAILED)
        current = current or t.generation[r] == job.generation
        changes.rank(r)
        detail = {
            "reason": reason,
            "rank_generation": t.generation[r],
            "last_heartbeat": last,
            "silent_s": None if last is None else now - last,
        }
        changes.event(job, EventKind.RANK_FAILED, now, r, detail)
    if current:
        job.failures += 1
        new_generation(job, now, f"rank(s) {short_list(ranks)} failed: {reason}", changes)


def short_list(ranks: list[int]) -> str:
    """At most eight ranks, then how many more."""
    more = f" (+{len(ranks) - 8})" if len(ranks) > 8 else ""
    return ", ".join(map(str, ranks[:8])) + more
