"""What the coordinator does: jobs, registration, heartbeats, checkpoints, failures, recovery.

Every operation validates its whole input first, then changes memory and writes one SQLite
transaction, so that a refused request (404, 409) has no effect at all. All methods run on
the event loop; none of them blocks on anything but a small local SQLite write.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from checkflow_server.db import Store
from checkflow_server.metrics import Metrics
from checkflow_server.state import (
    ABANDONED,
    ABORTED,
    ALIVE,
    COMMITTED,
    FAILED,
    FINISHED,
    IN_PROGRESS,
    UNKNOWN,
    Checkpoint,
    Job,
    Part,
    RankTable,
    Schedule,
)

from checkflow.policy import Profile, choose_interval

logger = logging.getLogger(__name__)

CONTINUE = "continue"
ABORT = "abort"


class NotFound(LookupError):
    """Unknown job, rank or step (HTTP 404)."""


class Conflict(RuntimeError):
    """The request contradicts the job's state, e.g. a stale generation (HTTP 409)."""


@dataclass(slots=True)
class JobSpec:
    name: str
    world_size: int
    storage_uri: str | None = None
    max_overhead: float = 0.035
    heartbeat_timeout_s: float = 10.0


@dataclass(slots=True)
class RankReport:
    """One rank's heartbeat: where it is and what checkpoints cost it."""

    rank: int
    generation: int
    step: int
    iteration_s: float | None = None
    stall_s: float | None = None
    persist_s: float | None = None


class Coordinator:
    """The coordinator's state and rules, persisted through a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        *,
        warmup_interval: int = 10,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.warmup_interval = warmup_interval
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self.metrics = Metrics()
        self._registered: dict[int, int] = {}
        """Job id -> ranks registered in its current generation (recovery completes at world)."""

    # --- startup ------------------------------------------------------------------------
    def load(self) -> None:
        """Rebuild memory from the database; every alive rank gets a fresh grace period."""
        now = self.clock()
        for row in self.store.jobs():
            job = Job.from_row(row)
            t = job.ranks
            for rank_row in self.store.ranks(job.id):
                if rank_row["rank"] < job.world_size:
                    t.load(rank_row)
            for r in range(job.world_size):
                if t.state[r] == ALIVE:
                    # The coordinator was down, not the ranks: they could not reach it.
                    t.watch[r] = now
            current = [r for r in range(job.world_size) if t.generation[r] == job.generation]
            self._registered[job.id] = sum(1 for r in current if t.state[r] == ALIVE)
            job.max_step = max([t.step[r] for r in current] + [job.max_step])
            for ck_row in self.store.checkpoints(job.id):
                ck = Checkpoint(**ck_row)
                if ck.status == IN_PROGRESS:
                    for p in self.store.parts(job.id, ck.step):
                        ck.parts[p["rank"]] = Part(
                            p["rank"],
                            p["nbytes"],
                            p["duration_s"],
                            p["manifest_path"],
                            p["reported_at"],
                        )
                job.checkpoints[ck.step] = ck
            self.jobs[job.name] = job
        self.metrics.checkpoints_committed = sum(
            1 for j in self.jobs.values() for c in j.checkpoints.values() if c.status == COMMITTED
        )
        logger.info("coordinator state loaded: %d jobs", len(self.jobs))

    # --- jobs ---------------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> tuple[Job, bool]:
        """The job named ``spec.name``: created now (True) or the existing one (False).

        An existing job keeps its settings; only a different world size is taken (the job
        restarted elastically), which starts a new generation with fresh ranks.
        """
        job = self.jobs.get(spec.name)
        now = self.clock()
        if job is not None:
            if job.world_size != spec.world_size:
                self._resize(job, spec.world_size, now)
            return job, False
        job = Job(
            id=0,
            name=spec.name,
            storage_uri=spec.storage_uri,
            world_size=spec.world_size,
            max_overhead=spec.max_overhead,
            heartbeat_timeout_s=spec.heartbeat_timeout_s,
            created=now,
            generation=1,
            generation_started=now,
            schedule=Schedule(self.warmup_interval, self.warmup_interval),
        )
        with self.store.transaction():
            # Rank rows are written when ranks register: creating a big job stays cheap.
            job.id = self.store.insert_job(job.row())
            self._event(job, "job_created", now, None, {"world_size": spec.world_size})
        self.jobs[job.name] = job
        self._registered[job.id] = 0
        return job, True

    def job(self, name: str) -> Job:
        job = self.jobs.get(name)
        if job is None:
            raise NotFound(f"job {name!r} not found")
        return job

    def _resize(self, job: Job, world_size: int, now: float) -> None:
        old = job.world_size
        job.world_size = world_size
        job.ranks = RankTable(world_size)
        with self.store.transaction():
            self.store.conn.execute("DELETE FROM ranks WHERE job_id=?", (job.id,))
            self._event(
                job, "resized", now, None, {"old_world_size": old, "world_size": world_size}
            )
            self._new_generation(job, now, f"world size changed from {old} to {world_size}")

    # --- ranks --------------------------------------------------------------------------
    def register(
        self, name: str, rank: int, *, instance: str | None = None, node: str | None = None
    ) -> Job:
        """Register ``rank`` in the job's current generation.

        A rank that registers again while alive in the current generation crashed and
        restarted: it is declared failed and the job moves to a new generation first. The
        same ``instance`` registering twice is a retry, not a crash.
        """
        job = self.job(name)
        self._check_rank(job, rank)
        now = self.clock()
        t = job.ranks
        with self.store.transaction():
            if t.state[rank] == ALIVE and t.generation[rank] == job.generation:
                if instance is not None and instance == t.instance[rank]:
                    t.watch[rank] = now
                    return job
                self._declare_failed(job, [rank], now, reason="re-registered after a crash")
            t.generation[rank] = job.generation
            t.state[rank] = ALIVE
            t.instance[rank] = instance
            t.node[rank] = node
            t.registered_at[rank] = now
            t.last_heartbeat[rank] = now
            t.watch[rank] = now
            t.step[rank] = job.restore_step() or 0
            # Measurements from the previous process of this rank describe another run.
            t.iteration_s[rank] = t.stall_s[rank] = t.persist_s[rank] = UNKNOWN
            self.store.upsert_ranks(job.id, [t.row(rank)])
            self._registered[job.id] += 1
            if job.recovering_since is not None and self._registered[job.id] >= job.world_size:
                duration = now - job.recovering_since
                job.recovering_since = None
                self.metrics.recovery_durations.append(duration)
                self._event(job, "recovered", now, None, {"duration_s": duration})
                self.store.update_job(job.row())
        return job

    def heartbeat(
        self, name: str, reports: Sequence[RankReport], *, node: str | None = None
    ) -> tuple[Job, list[str]]:
        """Record heartbeats (one rank, or every local rank of a node); actions per report.

        A report from an older generation (or from a rank that is not alive in it) gets
        ``abort``: the job moved on and this process must exit so the group restarts.

        Raises:
            NotFound: unknown job or rank (nothing is recorded).
            Conflict: a generation the coordinator never issued (nothing is recorded).
        """
        job = self.job(name)
        g = job.generation
        for rep in reports:
            self._check_rank(job, rep.rank)
            if rep.generation > g:
                raise Conflict(
                    f"rank {rep.rank}: generation {rep.generation} is newer than the job's "
                    f"generation {g}; register again"
                )
        now = self.clock()
        t = job.ranks
        actions: list[str] = []
        updates: list[tuple[Any, ...]] = []
        aborted: list[tuple[str, int]] = []
        max_step = job.max_step
        for rep in reports:
            r = rep.rank
            if rep.generation != g or t.generation[r] != g or t.state[r] != ALIVE:
                if t.generation[r] == rep.generation and t.state[r] == ALIVE:
                    t.state[r] = ABORTED
                    t.watch[r] = math.inf
                    aborted.append((ABORTED, r))
                actions.append(ABORT)
                continue
            actions.append(CONTINUE)
            t.last_heartbeat[r] = now
            t.watch[r] = now
            t.step[r] = rep.step
            max_step = max(max_step, rep.step)
            if rep.iteration_s is not None:
                t.iteration_s[r] = rep.iteration_s
            if rep.stall_s is not None:
                t.stall_s[r] = rep.stall_s
            if rep.persist_s is not None:
                t.persist_s[r] = rep.persist_s
            if node is not None:
                t.node[r] = node
            updates.append(
                (
                    now,
                    rep.step,
                    _opt(t.iteration_s[r]),
                    _opt(t.stall_s[r]),
                    _opt(t.persist_s[r]),
                    t.node[r],
                    r,
                )
            )
        job.max_step = max_step
        with self.store.transaction():
            if updates:
                self.store.save_heartbeats(job.id, updates)
            if aborted:
                self.store.set_rank_states(job.id, aborted)
        self.metrics.heartbeats += len(reports)
        return job, actions

    def finish(self, name: str, rank: int, generation: int, step: int | None = None) -> Job:
        """``rank`` ended training normally: stop watching it (its silence is no failure)."""
        job = self.job(name)
        self._check_rank(job, rank)
        t = job.ranks
        if generation != job.generation or t.generation[rank] != generation:
            raise Conflict(
                f"generation {generation} is not rank {rank}'s current generation {job.generation}"
            )
        if t.state[rank] == ALIVE:
            t.state[rank] = FINISHED
            t.watch[rank] = math.inf
            if step is not None:
                t.step[rank] = step
                job.max_step = max(job.max_step, step)
            with self.store.transaction():
                self.store.upsert_ranks(job.id, [t.row(rank)])
        return job

    # --- checkpoints --------------------------------------------------------------------
    def report_part(
        self,
        name: str,
        step: int,
        rank: int,
        *,
        generation: int,
        nbytes: int,
        duration_s: float,
        manifest_path: str,
    ) -> tuple[Checkpoint, bool]:
        """Record that ``rank`` persisted its part of ``step``; True when it must commit.

        Exactly one rank is told to commit: the one whose report completed the set (asked
        again, it gets True again, so a retried request is safe).
        """
        job = self.job(name)
        self._check_rank(job, rank)
        if generation != job.generation:
            raise Conflict(
                f"generation {generation} is not the job's current generation {job.generation}"
            )
        ck = job.checkpoints.get(step)
        if ck is not None and ck.status == COMMITTED:
            return ck, False
        # An abandoned attempt at this step from an older generation does not count: the
        # restarted group takes the step again from scratch.
        retry = ck is not None and ck.status == ABANDONED and ck.generation < generation
        if ck is not None and ck.status == ABANDONED and not retry:
            raise Conflict(f"checkpoint {step} was abandoned (the job moved on)")
        now = self.clock()
        if ck is None or retry:
            ck = Checkpoint(step=step, generation=generation, status=IN_PROGRESS, started=now)
            job.checkpoints[step] = ck
        old = ck.parts.get(rank)
        ck.nbytes += nbytes - (old.nbytes if old else 0)
        part = Part(rank, nbytes, duration_s, manifest_path, now)
        ck.parts[rank] = part
        ck.persisted = len(ck.parts)
        if len(ck.parts) == job.world_size and ck.committer is None:
            ck.committer = rank
        with self.store.transaction():
            if retry:
                self.store.delete_parts(job.id, step)
            self.store.upsert_checkpoint(job.id, ck.row())
            self.store.insert_part(job.id, {"step": step, **_part_row(part)})
        return ck, ck.committer == rank

    def commit(self, name: str, step: int, rank: int | None = None) -> Checkpoint:
        """The global manifest of ``step`` is written: it is a restore point from now on."""
        job = self.job(name)
        ck = job.checkpoints.get(step)
        if ck is None:
            raise NotFound(f"checkpoint {step} of job {name!r} not found")
        if ck.status == COMMITTED:
            return ck
        if ck.persisted < job.world_size:
            raise Conflict(
                f"checkpoint {step}: only {ck.persisted} of {job.world_size} ranks persisted"
            )
        now = self.clock()
        ck.status = COMMITTED
        ck.committed_at = now
        if rank is not None and ck.committer is None:
            ck.committer = rank
        with self.store.transaction():
            self.store.upsert_checkpoint(job.id, ck.row())
        self.metrics.checkpoints_committed += 1
        return ck

    def add_storage_commits(self, name: str, steps: Sequence[int]) -> int:
        """Mark steps found committed on storage (``MANIFEST.json``); how many were new."""
        job = self.jobs.get(name)
        if job is None:
            return 0
        now = self.clock()
        new = []
        for step in steps:
            ck = job.checkpoints.get(step)
            if ck is None:
                ck = Checkpoint(
                    step=step,
                    generation=job.generation,
                    status=COMMITTED,
                    started=now,
                    committed_at=now,
                    source="storage",
                )
                job.checkpoints[step] = ck
                new.append(ck)
            elif ck.status == IN_PROGRESS:
                ck.status, ck.committed_at = COMMITTED, now
                new.append(ck)
        if new:
            with self.store.transaction():
                for ck in new:
                    self.store.upsert_checkpoint(job.id, ck.row())
            self.metrics.checkpoints_committed += len(new)
        return len(new)

    # --- recovery -----------------------------------------------------------------------
    def recover(self, name: str, step: int | None = None) -> Job:
        """Roll the job back to committed ``step`` (default: the newest) in a new generation.

        Newer committed checkpoints are marked abandoned so that the restore point is
        ``step``; alive ranks are told to abort on their next heartbeat.
        """
        job = self.job(name)
        if step is not None:
            # 409, not 404: the URL names the job, which exists; the step in the body does
            # not fit its state.
            ck = job.checkpoints.get(step)
            if ck is None or ck.status != COMMITTED:
                state = "not found" if ck is None else ck.status
                raise Conflict(
                    f"checkpoint {step} of job {name!r} is {state}: only a committed "
                    "checkpoint can be restored"
                )
        now = self.clock()
        with self.store.transaction():
            if step is not None:
                for newer in job.checkpoints.values():
                    if newer.step > step and newer.status == COMMITTED:
                        newer.status = ABANDONED
                        self.store.upsert_checkpoint(job.id, newer.row())
            self._event(job, "rollback_requested", now, None, {"step": step})
            self._new_generation(job, now, "rollback requested")
        return job

    def detect(self) -> int:
        """Declare failed every watched rank silent for longer than its job's timeout."""
        now = self.clock()
        found = 0
        for job in list(self.jobs.values()):
            watch = job.ranks.watch
            deadline = now - job.heartbeat_timeout_s
            if min(watch, default=math.inf) >= deadline:
                continue
            silent = [r for r, seen in enumerate(watch) if seen < deadline]
            with self.store.transaction():
                self._declare_failed(job, silent, now, reason="missed heartbeats")
            found += len(silent)
        return found

    def retune(self) -> None:
        """Recompute every job's checkpoint interval from its ranks' latest reports."""
        for job in self.jobs.values():
            self._retune(job, self.clock())

    def _retune(self, job: Job, now: float) -> None:
        t = job.ranks
        # The slowest rank sets the pace of synchronous training and of its checkpoints.
        iteration = max(t.iteration_s, default=UNKNOWN)
        cost = max(t.stall_s, default=UNKNOWN)
        if iteration <= 0 or cost < 0:
            return
        old = job.schedule
        if old.prev_anchor is not None and job.max_step < old.anchor:
            return  # the previous change has not taken effect everywhere yet
        persist = max(0.0, max(t.persist_s))
        mtbf = (now - job.created) / job.failures if job.failures else None
        profile = Profile(iteration_s=iteration, cost_s=cost, persist_s=persist)
        new = choose_interval(profile, max_overhead=job.max_overhead, mtbf_s=mtbf)
        if new == old.interval:
            return
        # Far enough ahead that every live rank hears of it before getting there: a rank
        # that stays silent for longer than the timeout is declared failed anyway.
        lead = math.ceil(job.heartbeat_timeout_s / iteration) + 1
        anchor = old.first_at_or_after(job.max_step + lead)
        job.schedule = Schedule(anchor, new, old.anchor, old.interval)
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
        with self.store.transaction():
            self.store.update_job(job.row())
            self._event(job, "interval_changed", now, None, detail)
        logger.info("job %s: interval %d -> %d from step %d", job.name, old.interval, new, anchor)

    # --- internals (inside a transaction) -----------------------------------------------
    def _declare_failed(self, job: Job, ranks: list[int], now: float, *, reason: str) -> None:
        t = job.ranks
        current = False
        for r in ranks:
            last = t.last_heartbeat[r]
            t.state[r] = FAILED
            t.watch[r] = math.inf
            current = current or t.generation[r] == job.generation
            self._event(
                job,
                "rank_failed",
                now,
                r,
                {
                    "reason": reason,
                    "rank_generation": t.generation[r],
                    "last_heartbeat": last,
                    "silent_s": None if last is None else now - last,
                },
            )
        self.store.set_rank_states(job.id, [(FAILED, r) for r in ranks])
        self.metrics.failures_detected += len(ranks)
        logger.warning("job %s: rank(s) %s failed (%s)", job.name, _short(ranks), reason)
        if current:
            job.failures += 1
            self._new_generation(job, now, f"rank(s) {_short(ranks)} failed: {reason}")

    def _new_generation(self, job: Job, now: float, reason: str) -> None:
        job.generation += 1
        job.generation_started = now
        job.recovering_since = now
        self._registered[job.id] = 0
        for ck in job.checkpoints.values():
            if ck.status == IN_PROGRESS:
                ck.status = ABANDONED
                self.store.upsert_checkpoint(job.id, ck.row())
        restore = job.restore_step()
        base = restore or 0
        job.schedule = Schedule(base + job.schedule.interval, job.schedule.interval)
        job.max_step = base
        self.store.update_job(job.row())
        self._event(
            job, "generation_started", now, None, {"reason": reason, "restore_step": restore}
        )

    def _event(
        self, job: Job, kind: str, now: float, rank: int | None, detail: dict[str, Any]
    ) -> None:
        self.store.insert_event(job.id, now, kind, job.generation, rank, detail)

    @staticmethod
    def _check_rank(job: Job, rank: int) -> None:
        if not 0 <= rank < job.world_size:
            raise NotFound(f"rank {rank} not in job {job.name!r} (world size {job.world_size})")


def _opt(value: float) -> float | None:
    return None if value < 0 else value


def _part_row(p: Part) -> dict[str, Any]:
    return {
        "rank": p.rank,
        "nbytes": p.nbytes,
        "duration_s": p.duration_s,
        "manifest_path": p.manifest_path,
        "reported_at": p.reported_at,
    }


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8})" if len(ranks) > 8 else "")
