"""The coordinator service: each request runs its rule, writes what changed, counts it.

Every operation is ``decide -> persist -> metrics``: the rule (:mod:`.domain`) checks the
whole input first and refuses (404, 409) before changing anything, so a refused request
has no effect at all; what it changed is written in one transaction. Everything runs on
the event loop; nothing blocks on more than one small write.

With several replicas (PostgreSQL), ``jobs`` holds only the jobs this replica leases
(``domain/ownership.py``): a request for another job takes it over when its lease ran
out, or is refused with :class:`Elsewhere` (the API's 307 to the owner). A write the lease
fence refuses, or one the database could not take, drops the job from memory (it is
reloaded from the database when next needed): memory never runs ahead of what is stored.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from checkflow_server.domain import checkpoints, jobs, ownership, ranks, tuning, views
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.errors import Elsewhere, NotFound, StaleGeneration, Unavailable
from checkflow_server.domain.generation import short_list
from checkflow_server.domain.state import Job
from checkflow_server.metrics import Metrics, job_gauges
from checkflow_server.repository import Repository
from checkflow_server.repository.leases import LeaseLost
from sqlalchemy.exc import SQLAlchemyError

from checkflow.protocol import (
    CheckpointList,
    CheckpointPublic,
    CheckpointStatus,
    CommitReport,
    EventList,
    FailureReport,
    FinishRequest,
    Health,
    Heartbeat,
    HeartbeatReply,
    JobCreate,
    JobList,
    JobPublic,
    NodeHeartbeat,
    NodeHeartbeatReply,
    PartReply,
    PartReport,
    RankList,
    RankPublic,
    RecoverRequest,
    RegisterRequest,
    Registration,
    RestoredReport,
    RestorePoint,
    RetentionReport,
    StopRequest,
)

logger = logging.getLogger(__name__)

Reply = TypeVar("Reply")
T = TypeVar("T")


class Coordinator:
    """The coordinator's jobs in memory, written through to a :class:`Repository`."""

    def __init__(
        self,
        repository: Repository,
        *,
        warmup_interval: int = 10,
        hang_timeout_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.repository = repository
        self.leases = repository.leases
        """This replica's leases; None: it serves every job (one process, SQLite)."""
        self.warmup_interval = warmup_interval
        self.hang_timeout_s = hang_timeout_s
        """Hang timeout of jobs that set none; None: derived from their step times."""
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self.metrics = Metrics()
        self._warned_commit: set[str] = set()

    def load(self) -> None:
        """Rebuild memory from the database; every alive rank gets a fresh grace period.
        With leases: only the jobs this replica may take now (``take_over``)."""
        if self.leases is not None:
            self.take_over()
        else:
            now = self.clock()
            for job in self.repository.load_jobs():
                ranks.restarted(job, now)
                self.jobs[job.name] = job
        self.metrics.checkpoints_committed = sum(
            1
            for j in self.jobs.values()
            for c in j.checkpoints.values()
            if c.status == CheckpointStatus.COMMITTED
        )
        logger.info("coordinator state loaded: %d jobs", len(self.jobs))

    def job(self, name: str) -> Job:
        """The job named ``name`` as held here: taken over now when its lease allows it;
        ``Elsewhere`` when another replica serves it."""
        job = self.jobs.get(name)
        if job is not None:
            return job
        if self.leases is not None:
            for _ in range(2):  # a second look when another replica won the race to take it
                found = self._database(lambda: self._find(name))
                if found is not None:
                    return found
        raise NotFound(f"job {name!r} not found")

    def _find(self, name: str) -> Job | None:
        assert self.leases is not None
        found = self.leases.lookup(name)
        if found is None:
            raise NotFound(f"job {name!r} not found")
        job_id, lease, now = found
        if ownership.route(lease, self.leases.owner, now) == ownership.Route.REDIRECT:
            assert lease is not None
            raise Elsewhere(lease.owner)
        return self._take(job_id, lease)

    # --- leases (several replicas) ------------------------------------------------------
    def take_over(self) -> int:
        """Take every job whose lease ran out (or is this replica's from before a restart)
        and load it: its ranks get a fresh grace period, and the detector watches them
        from now on. How many."""
        assert self.leases is not None
        taken = 0
        for job_id, lease in self.leases.takeable():
            taken += self._take(job_id, lease) is not None
        return taken

    def _take(self, job_id: int, lease: ownership.Lease | None) -> Job | None:
        assert self.leases is not None
        if not self.leases.claim(job_id, lease):
            return None  # another replica was first
        [job] = self.repository.load_jobs([job_id])
        ranks.restarted(job, self.clock())
        self.jobs[job.name] = job
        epoch = self.leases.epochs.get(job_id)
        logger.info("job %s: served here from now on (lease epoch %s)", job.name, epoch)
        return job

    def renew(self) -> int:
        """Renew this replica's leases; drop the jobs it turned out to have lost. How many."""
        assert self.leases is not None
        lost = self.leases.renew()
        for job in [j for j in self.jobs.values() if j.id in lost]:
            logger.warning("job %s: its lease was taken by another replica", job.name)
            self._drop(job)
        return len(lost)

    def _drop(self, job: Job) -> None:
        self.jobs.pop(job.name, None)
        self.repository.forget(job)
        if self.leases is not None:
            self.leases.release(job.id)

    def _me(self) -> str | None:
        return self.leases.owner if self.leases is not None else None

    def _database(self, read: Callable[[], T]) -> T:
        """``read()``, with a database that cannot be reached as ``Unavailable`` (503)."""
        try:
            return read()
        except SQLAlchemyError as e:
            raise Unavailable(f"the coordinator's database is unavailable: {_why(e)}") from e

    # --- jobs ---------------------------------------------------------------------------
    def create_job(self, body: JobCreate) -> tuple[JobPublic, bool]:
        """The job named ``body.name``: created now (True) or the existing one (False)."""
        existing = self.jobs.get(body.name)
        if existing is None and self.leases is not None:
            # Stored by another replica: taken over here, or Elsewhere (307 to its owner).
            with contextlib.suppress(NotFound):
                existing = self.job(body.name)
        if existing is not None:
            changes = jobs.reopen_job(existing, body, self.clock(), self.warmup_interval)
            self._save(existing, changes)
            return views.job_public(existing), False
        job, changes = jobs.create_job(body, self.clock(), self.warmup_interval)
        self._save(job, changes)
        self.jobs[job.name] = job
        return views.job_public(job), True

    def get_job(self, name: str) -> JobPublic:
        return views.job_public(self.job(name))

    def list_jobs(self) -> JobList:
        """Every job: those served here from memory, the others as stored."""
        found = list(self.jobs.values())
        if self.leases is not None:
            stored = self._database(self.repository.load_jobs)
            found += [j for j in stored if j.name not in self.jobs]
            found.sort(key=lambda j: j.id)
        return JobList(jobs=[views.job_public(j) for j in found])

    def restore_point(self, name: str) -> RestorePoint:
        return views.restore_point(self.job(name))

    def recover(self, name: str, body: RecoverRequest) -> RestorePoint:
        job = self.job(name)
        return self._apply(job, *jobs.recover(job, body, self.clock()))

    def stop(self, name: str, body: StopRequest) -> JobPublic:
        job = self.job(name)
        return self._apply(job, *jobs.stop(job, body, self.clock()))

    def events(self, name: str, *, after: int, limit: int, kinds: Iterable[str] = ()) -> EventList:
        job = self.job(name)
        found = self._database(
            lambda: self.repository.events(job, after=after, limit=limit, kinds=kinds)
        )
        return EventList(events=found)

    # --- ranks --------------------------------------------------------------------------
    def register(self, name: str, rank: int, body: RegisterRequest) -> Registration:
        job = self.job(name)
        return self._apply(job, *ranks.register(job, rank, body, self.clock()))

    def rank_heartbeat(self, name: str, rank: int, body: Heartbeat) -> HeartbeatReply:
        job = self.job(name)
        try:
            return self._apply(job, *ranks.rank_heartbeat(job, rank, body, self.clock()))
        except StaleGeneration as e:  # refused; only that its rank heard is recorded
            self._save(job, e.changes)
            raise

    def node_heartbeat(self, name: str, node: str, body: NodeHeartbeat) -> NodeHeartbeatReply:
        job = self.job(name)
        return self._apply(job, *ranks.node_heartbeat(job, node, body, self.clock()))

    def finish(self, name: str, rank: int, body: FinishRequest) -> RankPublic:
        job = self.job(name)
        return self._apply(job, *ranks.finish(job, rank, body, self.clock()))

    def report_failure(self, name: str, rank: int, body: FailureReport) -> RankPublic:
        job = self.job(name)
        return self._apply(job, *ranks.report_failure(job, rank, body, self.clock()))

    def list_ranks(self, name: str) -> RankList:
        job, now = self.job(name), self.clock()
        return RankList(ranks=[views.rank_public(job, r, now) for r in range(job.world_size)])

    # --- checkpoints --------------------------------------------------------------------
    def report_part(self, name: str, step: int, rank: int, body: PartReport) -> PartReply:
        job = self.job(name)
        return self._apply(job, *checkpoints.report_part(job, step, rank, body, self.clock()))

    def commit(self, name: str, step: int, body: CommitReport) -> CheckpointPublic:
        job = self.job(name)
        if body.generation is None and name not in self._warned_commit:
            self._warned_commit.add(name)
            logger.warning(
                "job %s: a commit without its generation (an older client): deprecated, "
                "fenced by the checkpoint's generation only; upgrade its ranks",
                name,
            )
        return self._apply(job, *checkpoints.commit(job, step, body, self.clock()))

    def restored(self, name: str, rank: int, body: RestoredReport) -> RestorePoint:
        job = self.job(name)
        return self._apply(job, *checkpoints.restored(job, rank, body, self.clock()))

    def retention(self, name: str, rank: int, body: RetentionReport) -> JobPublic:
        job = self.job(name)
        self._apply(job, *checkpoints.retention(job, rank, body, self.clock()))
        self.metrics.retention_reported(name, failed=body.failed > 0)
        return views.job_public(job)

    def list_checkpoints(self, name: str, *, limit: int) -> CheckpointList:
        job = self.job(name)
        newest = sorted(job.checkpoints, reverse=True)[:limit]
        return CheckpointList(
            checkpoints=[views.checkpoint_public(job, job.checkpoints[s]) for s in newest]
        )

    def learn_commits(self, name: str, steps: Iterable[int]) -> int:
        """Mark steps found committed on storage; how many were new (0: unknown job)."""
        job = self.jobs.get(name)
        if job is None:
            return 0
        changes = checkpoints.learn_commits(job, steps, self.clock())
        self._save(job, changes)
        return changes.committed

    # --- background sweeps --------------------------------------------------------------
    def detect(self) -> int:
        """Declare failed every watched rank silent, or hung, for longer than its job's
        timeouts; how many."""
        now = self.clock()
        found = 0
        for job in list(self.jobs.values()):
            changes = ranks.detect(job, now, self.hang_timeout_s)
            try:
                self._save(job, changes)
            except (Elsewhere, Unavailable):
                continue  # dropped: its new owner (or this one, reloaded) decides again
            found += sum(1 for e in changes.events if e.kind == EventKind.RANK_FAILED)
        return found

    def retune(self) -> None:
        """Recompute every job's checkpoint interval from its ranks' latest reports."""
        for job in list(self.jobs.values()):
            try:
                self._save(job, tuning.retune(job, self.clock()))
            except (Elsewhere, Unavailable):
                continue

    def health(self) -> Health:
        return Health(status="ok", jobs=len(self.jobs))

    def render_metrics(self) -> str:
        """``/metrics``: the counters and every job's gauges (``metrics.JOB_GAUGES``)."""
        return self.metrics.render([job_gauges(j) for j in self.jobs.values()])

    # --- the one path of every change ---------------------------------------------------
    def _apply(self, job: Job, reply: Reply, changes: Changes) -> Reply:
        self._save(job, changes)
        return reply

    def _save(self, job: Job, changes: Changes) -> None:
        try:
            self.repository.save(job, changes)
        except LeaseLost:
            self._drop(job)
            found = self._database(lambda: self.leases.lookup(job.name) if self.leases else None)
            lease = found[1] if found is not None else None
            if lease is None or lease.owner == self._me():
                raise Unavailable("the job changed hands: retry") from None
            raise Elsewhere(lease.owner) from None
        except SQLAlchemyError as e:
            if self.leases is None:
                raise  # one process: as before leases, the job stays as it is in memory
            self._drop(job)
            raise Unavailable(f"the coordinator's database is unavailable: {_why(e)}") from e
        self.metrics.observe(changes)
        _log(job, changes)


def _why(e: SQLAlchemyError) -> str:
    """The first line of a driver's error, without SQLAlchemy's statement and link."""
    cause = getattr(e, "orig", None) or e
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__


def _log(job: Job, changes: Changes) -> None:
    failed = [e for e in changes.events if e.kind == EventKind.RANK_FAILED]
    if failed:
        reason = failed[0].detail["reason"]
        who = short_list([e.rank for e in failed if e.rank is not None])
        logger.warning("job %s: rank(s) %s failed (%s)", job.name, who, reason)
    for e in changes.events:
        if e.kind == EventKind.INTERVAL_CHANGED:
            d = e.detail
            logger.info(
                "job %s: interval %d -> %d (adopted at step %d at the latest)",
                job.name,
                d["old_interval"],
                d["interval"],
                d["from_step"],
            )
