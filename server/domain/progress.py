"""Hang detection from training progress, and when a recovered job trains again.

A rank whose heartbeats arrive but whose step stands still is hung: its heartbeat thread
lives while its training thread is stuck (in Python, or in a collective that never
completes because another rank is stuck). Liveness cannot see that; progress can
(nvidia-resiliency-ext watches progress the same way).

Each watched rank has a progress clock, ``RankTable.progress_at``: restarted when its
heartbeat carries a new step, when it says it is ``paused`` (eval, a blocking save), at
registration and at a coordinator restart. A rank is hung once its clock is older than
the job's hang timeout (:func:`hang_timeout`), or :data:`WARMUP_GRACE_S` while it has not
yet trained past the step it registered at (restore, compilation, warm-up). When every
rank is still, the whole job is stalled in a collective: all of them are hung, and the job
moves to a new generation like after any failure.
"""

from __future__ import annotations

import statistics

from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.generation import declare_failed
from checkflow_server.domain.state import Job

from checkflow.protocol import FaultKind

HANG_ITERATIONS = 10.0
"""A derived hang timeout is this many median step times: a step ten times slower than
usual is far outside the noise of data loading, garbage collection or a checkpoint stall,
and still found within seconds for a job of sub-second steps."""
HANG_FLOOR_S = 60.0
"""A derived hang timeout is never shorter: occasional slow steps (a data loader refill, a
synchronous log, a slow storage call) must not be taken for hangs when the job did not say
what it expects. Set ``hang_timeout`` for faster detection."""
WARMUP_GRACE_S = 300.0
"""Until a rank trained past the step it registered at, it may stand still this long (or
the job's hang timeout, if longer): restoring from remote storage, ``torch.compile`` and
the first collectives of a large job take minutes, and no step time is known yet."""


def hang_timeout(job: Job, default_s: float | None) -> float:
    """Seconds a trained-in rank's step may stand still: the job's ``hang_timeout_s``, else
    the coordinator's default (``--hang-timeout``), else :data:`HANG_ITERATIONS` times the
    median of the ranks' reported step times, at least :data:`HANG_FLOOR_S`."""
    setting = job.hang_timeout_s if job.hang_timeout_s is not None else default_s
    if setting is not None:
        return setting
    known = [s for s in job.ranks.iteration_s if s >= 0]
    median = statistics.median(known) if known else 0.0
    return max(HANG_FLOOR_S, HANG_ITERATIONS * median)


def note_progress(job: Job, rank: int, step: int, paused: bool, now: float) -> None:
    """Restart ``rank``'s progress clock if ``step`` is new or the rank is paused; call
    before the heartbeat's step is recorded. A paused rank holds every rank's clock: the
    others wait for it in their next collective."""
    t = job.ranks
    if paused:
        t.progress_at[rank] = job.paused_at = now
    elif step != t.step[rank]:
        t.progress_at[rank] = now


def detect_hangs(job: Job, now: float, default_s: float | None) -> Changes:
    """Declare hung every rank of the current generation whose progress clock is older
    than its limit (:func:`hang_timeout`, or the warm-up grace); see the module docstring.

    The detection latency of each is ``now`` minus when its step last advanced: the rank
    stopped somewhere within the step after that, so this overstates by less than one step
    time (and a rank that never advanced counts from its registration).
    """
    changes = Changes()
    t = job.ranks
    pause = job.paused_at
    # No limit is shorter than the setting (or, derived, than the floor): the common case
    # costs one min() per sweep.
    setting = job.hang_timeout_s if job.hang_timeout_s is not None else default_s
    shortest = setting if setting is not None else HANG_FLOOR_S
    if now - max(min(t.progress_at, default=now), pause) <= shortest:
        return changes
    timeout = hang_timeout(job, default_s)
    warmup = max(timeout, WARMUP_GRACE_S)
    g = job.generation
    hung: list[tuple[int, float | None]] = []
    for r, since in enumerate(t.progress_at):
        if t.generation[r] != g:
            continue
        still = now - max(since, pause)
        if still > (timeout if t.step[r] > t.start_step[r] else warmup):
            hung.append((r, still))
    if not hung:
        return changes
    whole = len(hung) == job.alive_ranks()
    reason = (
        f"no rank's step advanced for {timeout:g} s: the whole job is stalled (a collective "
        "that never completes)"
        if whole
        else f"step did not advance for {timeout:g} s while heartbeats went on"
    )
    declare_failed(job, hung, now, FaultKind.HUNG, reason, changes)
    return changes


def note_trained(job: Job, rank: int, step: int, now: float, changes: Changes) -> None:
    """The job trained again after a recovery: the first heartbeat of the new generation,
    from any rank, whose step is past the step that rank restored (in synchronous training
    no rank passes a step alone). Records the ``trained_again`` event, once."""
    recovery = job.recovery
    t = job.ranks
    if recovery is None or step <= t.start_step[rank]:
        return
    job.recovery = None
    recovery_s = now - recovery.started
    detection = recovery.detection_s
    detail = {
        "fault_kind": recovery.kind,
        "failed_ranks": recovery.ranks,
        "detection_s": detection,
        "restore_step": t.start_step[rank],
        "step": step,
        "recovery_s": recovery_s,
        "fault_to_training_s": None if detection is None else detection + recovery_s,
    }
    changes.event(job, EventKind.TRAINED_AGAIN, now, rank, detail)
