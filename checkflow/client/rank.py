"""One rank's client of the checkflow coordinator, and the in-rank watchdog.

One :class:`CoordinatorClient` per rank. It registers, sends heartbeats from a daemon
thread, reports persisted parts, and learns the checkpoint schedule from the replies. When
the coordinator answers ``abort`` (the job moved to a new generation because some rank
failed) it logs why and ends the process with :data:`ABORT_EXIT_CODE`, so that torchrun or
Kubernetes restarts the whole group, which then registers and restores.

Training never waits on the network: :meth:`CoordinatorClient.report_progress` only stores
values for the next heartbeat; when the coordinator is down the rank keeps its last
schedule, retries with backoff, logs once, and catches up when it is back.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress

import httpx
from pydantic import ValidationError

from checkflow.client import endpoints
from checkflow.client.backoff import next_delay
from checkflow.client.endpoints import Failover
from checkflow.client.progress import ProgressReport
from checkflow.client.transport import Channel, CoordinatorUnavailable, Reachability, why
from checkflow.protocol import (
    Action,
    CheckpointKind,
    CheckpointPublic,
    CheckpointTier,
    CommitReport,
    FinishRequest,
    HeartbeatReply,
    IntervalMode,
    JobCreate,
    JobPublic,
    PartReply,
    PartReport,
    RankPublic,
    RegisterRequest,
    Registration,
    RestoredReport,
    RestorePoint,
    RetentionReport,
    Schedule,
    paths,
)

logger = logging.getLogger(__name__)

ABORT_EXIT_CODE = 75
"""Exit status of a rank told to abort (EX_TEMPFAIL: restart the group and try again)."""


class CoordinatorClient:
    """One rank's link to the coordinator.

    Call order: :meth:`register` (before restoring), :meth:`start`, :meth:`report_progress`
    after every step, :attr:`tuned_interval`, :meth:`report_persisted` (persist thread),
    :meth:`report_committed`, :meth:`close`.

    Args:
        url: Base URL of the coordinator, e.g. ``http://coord:8470``, or several replicas'
            comma-separated (:mod:`checkflow.client.endpoints`).
        job: Job name (created on first registration).
        rank: This process's global rank.
        world_size: Number of ranks of the job.
        token: Bearer token of the coordinator, if it has one.
        storage_uri: Where the job's checkpoints live (the coordinator lists commits there).
        max_overhead: Fraction of training time checkpoints may take (job setting).
        heartbeat_interval_s: Seconds between heartbeats.
        timeout_s: Timeout of each HTTP request.
        heartbeat_timeout_s: Silence after which the coordinator declares a rank failed
            (job setting, used when this call creates the job).
        hang_timeout_s: Seconds a rank's step may stand still before the coordinator
            declares it hung (job setting); None: derived from the step times.
        every: A fixed checkpoint interval; None: ``every="auto"`` (the coordinator's).
        on_abort: Called with the reason when the coordinator says ``abort``. Default:
            log an error line and ``os._exit(ABORT_EXIT_CODE)``.

    Raises:
        ValueError: a bad URL list, a rank outside ``world_size``, or a job setting the
            coordinator would refuse (e.g. a job name with a ``/``): said now rather than
            training on without a coordinator.
    """

    ABORT_EXIT_CODE: int = ABORT_EXIT_CODE

    def __init__(
        self,
        url: str,
        job: str,
        rank: int,
        world_size: int,
        *,
        token: str | None = None,
        storage_uri: str | None = None,
        max_overhead: float = 0.035,
        heartbeat_interval_s: float = 1.0,
        timeout_s: float = 2.0,
        heartbeat_timeout_s: float = 10.0,
        hang_timeout_s: float | None = None,
        every: int | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        failover = Failover(endpoints.parse(url))
        self.url = str(failover.coordinators)
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.storage_uri = storage_uri
        self.max_overhead = max_overhead
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        try:
            self._job_create = JobCreate(
                name=job,
                world_size=world_size,
                storage_uri=storage_uri or None,
                max_overhead=max_overhead,
                heartbeat_timeout_s=heartbeat_timeout_s,
                hang_timeout_s=hang_timeout_s,
                every=every,
            )
        except ValidationError as e:
            raise ValueError(f"job settings the coordinator would refuse: {e}") from e
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a job of world size {world_size}")
        self.on_abort = on_abort or self._exit_on_abort
        self.instance = uuid.uuid4().hex
        # Two connections: the heartbeat thread must never queue behind a persist report.
        self._reports = Channel(failover, token, timeout_s)
        self._beats = Channel(failover, token, timeout_s)
        self._generation: int | None = None
        self._schedule: Schedule | None = None
        self._progress = ProgressReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._aborted = False
        self._reach = Reachability(self.url, rank)
        self._advised: int | None = None

    # --- public API ---------------------------------------------------------------------
    def register(self) -> Registration | None:
        """Create the job if needed and register this rank.

        Returns:
            The registration, or None when the coordinator is unreachable or refuses
            (logged once; the heartbeat thread keeps trying to register later).
        """
        try:
            return self._register(self._reports)
        except CoordinatorUnavailable as e:
            self._reach.lost(e, self.interval)
            return None
        except httpx.HTTPStatusError as e:
            logger.error("coordinator refused registration of rank %d: %s", self.rank, why(e))
            return None

    def start(self) -> None:
        """Start the heartbeat thread (a daemon: it never keeps the process alive)."""
        if self._thread is not None:
            return
        name = f"checkflow-heartbeat-{self.rank}"
        self._thread = threading.Thread(target=self._heartbeat_loop, name=name, daemon=True)
        self._thread.start()

    def report_progress(
        self,
        step: int,
        iteration_s: float | None = None,
        stall_s: float | None = None,
        persist_s: float | None = None,
    ) -> None:
        """Latest step and measurements, sent with the next heartbeat. Never blocks."""
        self._progress.update(step, iteration_s, stall_s, persist_s)

    def paused(self) -> AbstractContextManager[None]:
        """``with client.paused():`` a known pause (eval, a blocking save): its still step
        is no hang. Nestable, and usable from any thread."""
        return self._progress.paused()

    @property
    def generation(self) -> int | None:
        return self._generation

    @property
    def schedule(self) -> Schedule | None:
        """The job's checkpoint schedule from the latest reply (None before any reply)."""
        return self._schedule

    @property
    def interval(self) -> int | None:
        return None if self._schedule is None else self._schedule.interval

    @property
    def tuned_interval(self) -> int | None:
        """The coordinator's ``every="auto"`` interval once tuned (None: not yet, no reply)."""
        s = self._schedule
        return s.interval if s is not None and s.mode == IntervalMode.TUNED else None

    def report_persisted(
        self,
        step: int,
        nbytes: int,
        duration_s: float,
        manifest_path: str,
        tier: str = "storage",
        kind: str | None = None,
        jit: bool = False,
    ) -> bool | None:
        """This rank persisted its part of ``step`` in ``tier`` (``kind``: full or delta;
        ``jit``: a just-in-time RAM copy, standing for every rank's part); call from a persist
        thread. Returns True: this rank writes the commit (it completed the set); False: it
        must not (others persisting, an ended generation, the RAM tier); None: no answer."""
        if self._generation is None:
            return None
        try:
            body = PartReport(
                generation=self._generation,
                nbytes=nbytes,
                duration_s=duration_s,
                manifest_path=manifest_path,
                tier=None if tier == "storage" else CheckpointTier(tier),
                kind=None if kind is None else CheckpointKind(kind),
                jit=jit or None,
            )
        except ValidationError as e:  # the coordinator would refuse it: agree locally
            logger.warning("checkpoint %d: report not sent (it would be refused): %s", step, e)
            return None
        path = paths.path(paths.PART, job=self.job, step=step, rank=self.rank)
        try:
            reply = self._reports.call("PUT", path, body, PartReply)
        except CoordinatorUnavailable as e:
            self._reach.lost(e, self.interval)
            return None
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 409:
                logger.warning("checkpoint %d: coordinator says %s", step, why(e))
                return False
            logger.warning("checkpoint %d: coordinator refused the report: %s", step, why(e))
            return None
        return reply.must_commit

    def report_committed(self, step: int) -> None:
        """The global manifest of ``step`` is written (this rank committed it)."""
        path = paths.path(paths.COMMIT, job=self.job, step=step)
        body = CommitReport(rank=self.rank, generation=self._generation)
        try:
            self._reports.call("POST", path, body, CheckpointPublic)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            # Not fatal: the coordinator also learns commits by listing storage.
            logger.warning("could not report commit of step %d: %s", step, e)

    def report_restored(self, asked: int | None, step: int | None) -> None:
        """This rank restored ``step`` (None: nothing) below ``asked``, the coordinator's restore
        point (not on storage, or restore(step=N)): it abandons the steps above; never raises."""
        below = asked is not None and (step is None or step < asked)
        if self._generation is None or asked != self._advised or not below:
            return
        body = RestoredReport(generation=self._generation, advised=asked, step=step)
        path = paths.path(paths.RESTORED, job=self.job, rank=self.rank)
        try:
            self._reports.call("POST", path, body, RestorePoint)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            logger.warning("could not report the step rank %d restored: %s", self.rank, e)

    def report_retention(self, report: RetentionReport) -> None:
        """Retention after a commit failed (``report.failed`` > 0) or works again."""
        path = paths.path(paths.RETENTION, job=self.job, rank=self.rank)
        self._reports.tell(path, report, JobPublic, f"retention after step {report.step}")

    def finish(self) -> None:
        """Training ended normally: the coordinator stops watching this rank. Call it before
        :meth:`close`; without it, the rank's silence after exit is declared a failure."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._generation is None:
            return
        with suppress(CoordinatorUnavailable, httpx.HTTPStatusError):
            # A short run (or last round) can end between two beats: send its step times.
            self._send_beat(self._reports, self._generation)
        path = paths.path(paths.FINISH, job=self.job, rank=self.rank)
        step = None if self._progress.step is None else max(0, self._progress.step)
        body = FinishRequest(generation=self._generation, step=step)
        try:
            self._reports.call("POST", path, body, RankPublic)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            logger.warning("could not tell the coordinator that rank %d finished: %s", self.rank, e)

    def exit_if_aborted(self) -> None:
        """Training failed: ask the coordinator now whether this rank's generation ended
        (a peer aborted, which fails this rank's collectives); if so, abort as the heartbeat
        thread would (``on_abort``: exit 75, restart) instead of failing like a crash.
        Returns when the coordinator says continue or cannot be reached."""
        if self._generation is None or self._aborted:
            return
        try:
            self._beat()
        except CoordinatorUnavailable as e:
            self._reach.lost(e, self.interval)

    def close(self) -> None:
        """Stop the heartbeat thread and close connections."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._reports.close()
        self._beats.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------
    def _register(self, channel: Channel) -> Registration:
        channel.call("POST", paths.path(paths.JOBS), self._job_create, JobPublic)
        body = RegisterRequest(instance=self.instance, node=socket.gethostname()[:256])
        path = paths.path(paths.REGISTER, job=self.job, rank=self.rank)
        reply = channel.call("POST", path, body, Registration)
        self._generation, self._advised = reply.generation, reply.restore_step
        self._schedule = reply.schedule
        self._reach.back()
        said = "rank %d registered with coordinator %s: generation %d, restore step %s"
        where = channel.failover.current
        logger.info(said, self.rank, where, reply.generation, reply.restore_step)
        return reply

    def _heartbeat_loop(self) -> None:
        delay = self.heartbeat_interval_s
        while not self._stop.wait(delay):
            try:
                self._beat()
                delay = self.heartbeat_interval_s
            except CoordinatorUnavailable as e:
                self._reach.lost(e, self.interval)
                delay = next_delay(delay, self.heartbeat_interval_s)
            except Exception:
                # The watchdog must survive anything; training goes on without it.
                logger.exception("heartbeat of rank %d failed", self.rank)
                delay = self.heartbeat_interval_s
            if self._aborted:
                return

    def _beat(self) -> None:
        if self._generation is None:
            try:
                self._register(self._beats)
            except httpx.HTTPStatusError as e:
                logger.error("coordinator refused registration: %s", why(e))
            return
        try:
            reply = self._send_beat(self._beats, self._generation)
        except httpx.HTTPStatusError as e:
            code = e.response.status_code
            if code == 409:
                self._abort(f"coordinator refused generation {self._generation}: {why(e)}")
            elif code == 404:
                # The coordinator lost this job (new database): register it again.
                logger.warning("coordinator does not know job %s; registering again", self.job)
                self._generation = None
            else:
                logger.error("heartbeat refused: %s", why(e))
            return
        self._reach.back()
        self._schedule = reply.schedule
        if reply.action == Action.ABORT:
            self._abort(
                f"job {self.job} moved to generation {reply.generation} (this rank is in "
                f"generation {self._generation}): another rank failed or a rollback was asked"
            )

    def _send_beat(self, channel: Channel, generation: int) -> HeartbeatReply:
        path = paths.path(paths.RANK_HEARTBEAT, job=self.job, rank=self.rank)
        return channel.call("POST", path, self._progress.heartbeat(generation), HeartbeatReply)

    def _abort(self, reason: str) -> None:
        self._aborted = True
        self._stop.set()
        self.on_abort(reason)

    def _exit_on_abort(self, reason: str) -> None:
        logger.error(
            "checkflow: rank %d aborting (exit code %d): %s", self.rank, ABORT_EXIT_CODE, reason
        )
        logging.shutdown()
        os._exit(ABORT_EXIT_CODE)
