"""Generations: how a job moves on after a failure, a resize or a roll-back.

A generation is one incarnation of the job's process group. When a rank fails, every rank
of the current generation must abort and the restarted group registers in the next one,
restoring the newest checkpoint that every rank committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from checkflow_server.domain import lifecycle
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import Job, Recovery

from checkflow.protocol import CheckpointStatus, FaultKind, IntervalMode, RankState


def new_generation(
    job: Job, now: float, reason: str, changes: Changes, recovery: Recovery | None = None
) -> None:
    """Start the job's next generation: in-flight checkpoints are abandoned, the schedule
    restarts from the restore point, and recovery lasts until every rank registered (and,
    for the ``trained_again`` event, until the job trained past its restore step)."""
    job.generation += 1
    job.generation_started = now
    job.recovering_since = now
    job.registered = 0
    job.recovery = recovery or Recovery(started=now, kind=None, detection_s=None, ranks="")
    job.state = lifecycle.on_new_generation(job.state)
    for ck in job.checkpoints.values():
        if ck.status == CheckpointStatus.IN_PROGRESS:
            ck.status = CheckpointStatus.ABANDONED
            changes.checkpoint(ck)
    restore = restart_schedule(job)
    changes.job = True
    detail: dict[str, Any] = {"reason": reason, "restore_step": restore}
    if recovery is not None:
        detail |= {
            "kind": recovery.kind,
            "detection_s": recovery.detection_s,
            "failed_ranks": recovery.ranks,
        }
    changes.event(job, EventKind.GENERATION_STARTED, now, None, detail)


def restart_schedule(job: Job) -> int | None:
    """The schedule restarts from the restore point (returned): the ranks train on from it
    (``every="auto"`` counts from it; a fixed ``every`` keeps its multiples)."""
    restore = job.restore_step()
    base = restore or 0
    s = job.schedule
    job.schedule = s if s.mode == IntervalMode.FIXED else s.model_copy(update={"anchor": base})
    job.max_step = base
    return restore


def declare_failed(
    job: Job,
    failures: Sequence[tuple[int, float | None]],
    now: float,
    kind: FaultKind,
    reason: str,
    changes: Changes,
) -> None:
    """Ranks failed, each given with its detection latency; if one of them belongs to the
    current generation, the job moves to the next (its other ranks learn it from their
    next heartbeat reply: abort).

    Detection latency is the time from the fault to this declaration, as well as the
    coordinator can know it: for ``silent`` and ``re_registered``, ``now`` minus the
    rank's last heartbeat (the process stopped after it; an overstatement by less than one
    heartbeat interval); for ``hung``, ``now`` minus when its step last advanced (see
    :func:`.progress.detect_hangs`); for ``crash``, the ``seconds_ago`` its launcher
    reported (the launcher's own polling delay is not in it). The job's latency is the
    smallest of its failed ranks': the job was evidently healthy until then.
    """
    t = job.ranks
    current = False
    for r, detection_s in failures:
        last = t.last_heartbeat[r]
        t.unwatch(r, RankState.FAILED)
        current = current or t.generation[r] == job.generation
        changes.rank(r)
        detail = {
            "reason": reason,
            "kind": kind,
            "detection_s": detection_s,
            "rank_generation": t.generation[r],
            "step": t.step[r],
            "last_heartbeat": last,
            "silent_s": None if last is None else now - last,
        }
        changes.event(job, EventKind.RANK_FAILED, now, r, detail)
    if current:
        job.failures += 1
        ranks = [r for r, _ in failures]
        known = [d for _, d in failures if d is not None]
        recovery = Recovery(now, kind, min(known) if known else None, short_list(ranks))
        why = f"rank(s) {short_list(ranks)} failed ({kind}): {reason}"
        new_generation(job, now, why, changes, recovery)


def silent_for(job: Job, rank: int, now: float) -> float | None:
    """Seconds since ``rank``'s last heartbeat (None: never heard from)."""
    last = job.ranks.last_heartbeat[rank]
    return None if last is None else now - last


def short_list(ranks: list[int]) -> str:
    """At most eight ranks, then how many more."""
    more = f" (+{len(ranks) - 8})" if len(ranks) > 8 else ""
    return ", ".join(map(str, ranks[:8])) + more
