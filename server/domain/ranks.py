"""Rules for ranks: registration, heartbeats (one rank or a node's), finishing, failure
detection, and the grace period after a coordinator restart.

A rank is watched by the failure detector while alive. A rank's heartbeat from an older
generation is refused (409: fenced, see :func:`_refuse_stale`); in a node's heartbeat, and
from a rank no longer alive in its generation, a report is answered ``abort``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from checkflow_server.domain import lifecycle
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.errors import Conflict, NotFound, StaleGeneration
from checkflow_server.domain.generation import declare_failed, silent_for
from checkflow_server.domain.jobs import settle_rollback
from checkflow_server.domain.progress import detect_hangs, note_progress, note_trained
from checkflow_server.domain.state import Job
from checkflow_server.domain.views import rank_public, registration, schedule_fields

from checkflow.protocol import (
    Action,
    FailureReport,
    FaultKind,
    FinishRequest,
    Heartbeat,
    HeartbeatReply,
    NodeHeartbeat,
    NodeHeartbeatReply,
    RankAction,
    RankPublic,
    RankState,
    RegisterRequest,
    Registration,
)

ALIVE = RankState.ALIVE
CONTINUE, ABORT = Action.CONTINUE, Action.ABORT
RE_REGISTERED = FaultKind.RE_REGISTERED


def check_rank(job: Job, rank: int) -> None:
    if not 0 <= rank < job.world_size:
        raise NotFound(f"rank {rank} not in job {job.name!r} (world size {job.world_size})")


def register(
    job: Job, rank: int, body: RegisterRequest, now: float
) -> tuple[Registration, Changes]:
    """Register ``rank`` in the job's current generation.

    A rank that registers again while alive in the current generation crashed and
    restarted: it is declared failed and the job moves to a new generation first. The
    same ``instance`` registering twice is a retry, not a crash.
    """
    check_rank(job, rank)
    t = job.ranks
    changes = Changes()
    if job.is_alive(rank):
        if body.instance is not None and body.instance == t.instance[rank]:
            t.watch[rank] = now
            return registration(job), changes
        failure = [(rank, silent_for(job, rank, now))]
        declare_failed(job, failure, now, RE_REGISTERED, "registered again while alive", changes)
    settle_rollback(job, changes)
    t.generation[rank] = job.generation
    t.state[rank] = ALIVE
    t.instance[rank] = body.instance
    t.node[rank] = body.node
    t.registered_at[rank] = t.last_heartbeat[rank] = t.watch[rank] = t.progress_at[rank] = now
    t.step[rank] = t.start_step[rank] = job.restore_step() or 0
    t.forget_measurements(rank)
    changes.rank(rank)
    job.registered += 1
    if job.recovering_since is not None and job.registered >= job.world_size:
        duration = now - job.recovering_since
        job.recovering_since = None
        changes.job = True
        changes.event(job, EventKind.RECOVERED, now, None, {"duration_s": duration})
    state = lifecycle.on_registered(job.recovering_since is not None)
    if state != job.state:
        job.state, changes.job = state, True
    return registration(job), changes


def rank_heartbeat(
    job: Job, rank: int, body: Heartbeat, now: float
) -> tuple[HeartbeatReply, Changes]:
    """One rank's heartbeat; see :func:`record_heartbeats`."""
    (action,), changes = record_heartbeats(job, [(rank, body)], now, node=None)
    return HeartbeatReply(action=action, **schedule_fields(job)), changes


def node_heartbeat(
    job: Job, node: str, body: NodeHeartbeat, now: float
) -> tuple[NodeHeartbeatReply, Changes]:
    """One heartbeat carrying a node's local ranks; see :func:`record_heartbeats`."""
    reports = [(r.rank, r) for r in body.ranks]
    actions, changes = record_heartbeats(job, reports, now, node=node)
    ranks = [RankAction(rank=r.rank, action=a) for r, a in zip(body.ranks, actions, strict=True)]
    return NodeHeartbeatReply(ranks=ranks, **schedule_fields(job)), changes


def record_heartbeats(
    job: Job, reports: Sequence[tuple[int, Heartbeat]], now: float, *, node: str | None
) -> tuple[list[Action], Changes]:
    """Record ``(rank, heartbeat)`` reports; the action for each.

    Raises:
        NotFound: an unknown rank (nothing is recorded).
        Conflict: a generation the coordinator never issued (nothing is recorded).
    """
    g = job.generation
    for rank, hb in reports:
        check_rank(job, rank)
        if hb.generation > g:
            raise Conflict(
                f"rank {rank}: generation {hb.generation} is newer than the job's "
                f"generation {g}; register again"
            )
    t = job.ranks
    actions: list[Action] = []
    changes = Changes(heartbeats_received=len(reports))
    if node is None and reports[0][1].generation < g:
        _refuse_stale(job, *reports[0], changes)
    max_step = job.max_step
    for r, hb in reports:
        if hb.generation != g or t.generation[r] != g or t.state[r] != ALIVE:
            if t.generation[r] == hb.generation and t.state[r] == ALIVE:
                t.unwatch(r, RankState.ABORTED)
                changes.rank(r)
            actions.append(ABORT)
            continue
        actions.append(CONTINUE)
        t.last_heartbeat[r] = t.watch[r] = now
        note_progress(job, r, hb.step, hb.paused, now)
        note_trained(job, r, hb.step, now, changes)
        t.step[r] = hb.step
        max_step = max(max_step, hb.step)
        if hb.iteration_s is not None:
            t.iteration_s[r] = hb.iteration_s
        if hb.stall_s is not None:
            t.stall_s[r] = hb.stall_s
        if hb.persist_s is not None:
            t.persist_s[r] = hb.persist_s
        if node is not None:
            t.node[r] = node
        changes.heartbeats.append(r)
    job.max_step = max_step
    return actions, changes


def _refuse_stale(job: Job, rank: int, hb: Heartbeat, changes: Changes) -> None:
    """A rank's heartbeat from a generation the job left: 409 (its client aborts, exit 75);
    of all it says only that its rank heard of the end of its generation is recorded.
    A node's heartbeat is answered ``abort`` per stale rank instead (its other ranks'
    reports count)."""
    t = job.ranks
    if t.generation[rank] == hb.generation and t.state[rank] == ALIVE:
        t.unwatch(rank, RankState.ABORTED)
        changes.rank(rank)
    raise StaleGeneration(
        f"rank {rank}: generation {hb.generation} ended: the job moved to generation "
        f"{job.generation}; abort and register again",
        changes,
    )


def finish(job: Job, rank: int, body: FinishRequest, now: float) -> tuple[RankPublic, Changes]:
    """``rank`` ended training normally: stop watching it (its silence is no failure)."""
    check_rank(job, rank)
    t = job.ranks
    if body.generation != job.generation or t.generation[rank] != body.generation:
        raise Conflict(
            f"generation {body.generation} is not rank {rank}'s current generation {job.generation}"
        )
    changes = Changes()
    if t.state[rank] == ALIVE:
        t.unwatch(rank, RankState.FINISHED)
        if body.step is not None:
            t.step[rank] = body.step
            job.max_step = max(job.max_step, body.step)
        changes.rank(rank)
        state = lifecycle.on_finished(job.state, job.finished_ranks(), job.world_size)
        if state != job.state:
            job.state, changes.job = state, True
            detail = {"step": job.max_step}
            changes.event(job, EventKind.FINISHED, now, None, detail)
    return rank_public(job, rank, now), changes


def detect(job: Job, now: float, hang_default_s: float | None = None) -> Changes:
    """Declare failed every watched rank silent for longer than the job's heartbeat
    timeout (``silent``), then every rank whose step stood still too long (``hung``, see
    :func:`.progress.detect_hangs`; ``hang_default_s`` is the coordinator's default hang
    timeout for jobs without their own)."""
    watch = job.ranks.watch
    deadline = now - job.heartbeat_timeout_s
    changes = Changes()
    if min(watch, default=math.inf) < deadline:
        silent = [(r, silent_for(job, r, now)) for r, seen in enumerate(watch) if seen < deadline]
        reason = f"no heartbeat for {job.heartbeat_timeout_s:g} s"
        declare_failed(job, silent, now, FaultKind.SILENT, reason, changes)
    if not changes.events:
        return detect_hangs(job, now, hang_default_s)
    return changes


def report_failure(
    job: Job, rank: int, body: FailureReport, now: float
) -> tuple[RankPublic, Changes]:
    """A launcher saw ``rank``'s process exit with an error (``crash``): if the rank is
    alive in ``body.generation``, it is declared failed now, instead of after the
    heartbeat timeout; in the current generation the job moves on and the other ranks
    abort at their next heartbeat. A report about a rank that is no longer alive in that
    generation (told already, aborted, an older generation) changes nothing: launchers
    may report late or twice.

    Raises:
        NotFound: an unknown rank.
        Conflict: a generation the coordinator never issued.
    """
    check_rank(job, rank)
    if body.generation > job.generation:
        raise Conflict(
            f"generation {body.generation} is newer than job {job.name!r}'s generation "
            f"{job.generation}"
        )
    t = job.ranks
    changes = Changes()
    if t.state[rank] == ALIVE and t.generation[rank] == body.generation:
        code = "" if body.exit_code is None else f" with exit code {body.exit_code}"
        reason = f"its process exited{code}" + (f": {body.detail}" if body.detail else "")
        failure = [(rank, body.seconds_ago)]
        declare_failed(job, failure, now, FaultKind.CRASH, reason, changes)
    return rank_public(job, rank, now), changes


def restarted(job: Job, now: float) -> None:
    """The coordinator restarted with this job loaded: every alive rank gets a fresh grace
    period, for heartbeats and for progress (the coordinator was down, not the ranks: they
    could not report)."""
    t = job.ranks
    current = [r for r in range(job.world_size) if t.generation[r] == job.generation]
    for r in range(job.world_size):
        if t.state[r] == ALIVE:
            t.watch[r] = t.progress_at[r] = now
            # The step it registered at is not stored. During a recovery it was the
            # restore step; otherwise the rank gets the warm-up grace again until it
            # advances (slower to call a hang, never quicker).
            t.start_step[r] = (job.restore_step() or 0) if job.recovery else t.step[r]
    job.registered = sum(1 for r in current if t.state[r] == ALIVE)
    job.max_step = max([t.step[r] for r in current] + [job.max_step])
