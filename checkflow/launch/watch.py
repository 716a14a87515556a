"""The agent's view of its job at the coordinator, refreshed by a daemon thread.

The agent asks about once a second for the job and its ranks (``GET`` :data:`paths.JOB`
and :data:`paths.RANKS`) and sends its crash reports (``POST`` :data:`paths.FAILURE`) from
the same thread, and last of all that the launcher stopped (``POST`` :data:`paths.STOP`,
see :func:`watching`), so that the monitor loop never waits on the network: an unreachable or
slow coordinator must never stop or slow the job. It is logged once, and again when it is
back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from checkflow.client.env import CoordinatorSettings
from checkflow.client.transport import Channel, CoordinatorUnavailable, why
from checkflow.protocol import (
    FailureReport,
    JobPublic,
    RankList,
    RankPublic,
    StopReason,
    StopRequest,
    paths,
)

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0
"""Seconds between two looks at the job."""
REQUEST_TIMEOUT_S = 2.0
"""Timeout of each request: the thread waits, the monitor loop never does."""


@dataclass(frozen=True, slots=True)
class JobView:
    """The job and its ranks as the coordinator answered, and when the asking began."""

    generation: int
    ranks: dict[int, RankPublic]
    asked_at: float
    """``time.monotonic()`` when the request for this view was sent."""


class CoordinatorWatch:
    """Polls ``settings.job`` and sends failure reports from a daemon thread.

    Call order: :meth:`start`, then :meth:`view` / :meth:`refresh` / :meth:`report_failure`
    from the agent's monitor loop, :meth:`report_stop` when the launcher stops, and
    :meth:`close` at the end.
    """

    def __init__(self, settings: CoordinatorSettings, interval_s: float = POLL_INTERVAL_S):
        assert settings.url is not None and settings.job is not None
        self.url, self.job = settings.url, settings.job
        self.interval_s = interval_s
        # One budget over the replicas: refresh() is asked from the monitor loop.
        self._channel = Channel(settings.url, settings.token, REQUEST_TIMEOUT_S)
        self._reports: queue.Queue[tuple[int, int, float] | BaseException | None]
        self._reports = queue.Queue()
        self._view: JobView | None = None
        self._unreachable = False
        self._no_failure_route = False
        self._thread = threading.Thread(target=self._loop, name="checkflow-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._reports.put(None)
        self._thread.join(REQUEST_TIMEOUT_S * 3)
        self._channel.close()

    def view(self) -> JobView | None:
        """The newest view (None before the first answer); never blocks."""
        return self._view

    def refresh(self) -> JobView | None:
        """Ask now and return the new view, or None when the coordinator does not answer
        (within :data:`REQUEST_TIMEOUT_S`). For decisions that must not use an old view."""
        self._poll()
        return self._view

    def report_failure(self, rank: int, exit_code: int, seen_at: float) -> None:
        """Queue a crash report of global ``rank`` (seen exiting at ``time.monotonic()``
        ``seen_at``); the thread looks at the job again and sends it at once, with the
        generation the coordinator has for that rank."""
        self._reports.put((rank, exit_code, seen_at))

    def report_stop(self, error: BaseException) -> None:
        """Queue the report that the launcher stops for ``error`` (see :func:`stop_request`),
        so that the job shows stopped or failed instead of recovering for good. It goes
        after the crash reports queued before it (the job's log tells the crash, then the
        stop); :meth:`close` waits for it."""
        self._reports.put(error)

    # --- the thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        next_poll = 0.0
        while True:
            try:
                item = self._reports.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                self._poll()
                next_poll = time.monotonic() + self.interval_s
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                self._send_stop(item)
            else:
                self._send(*item)

    def _poll(self) -> None:
        asked_at = time.monotonic()
        try:
            job = self._channel.call("GET", paths.path(paths.JOB, job=self.job), None, JobPublic)
            ranks = self._channel.call("GET", paths.path(paths.RANKS, job=self.job), None, RankList)
        except CoordinatorUnavailable as e:
            self._note_unreachable(e)
            return
        except httpx.HTTPStatusError as e:
            # 404 before the first rank registered (the ranks create the job): not a fault.
            logger.debug("coordinator: no view of job %s: %s", self.job, why(e))
            return
        except Exception:
            logger.exception("coordinator %s: looking at job %s failed", self.url, self.job)
            return
        self._back_online()
        self._view = JobView(job.generation, {r.rank: r for r in ranks.ranks}, asked_at)

    def _send(self, rank: int, exit_code: int, seen_at: float) -> None:
        self._poll()  # the generation of the rank's crashed process, not an older view's
        view = self._view
        if view is None:
            logger.warning(
                "checkflow: rank %d crashed (exit code %d); not reported: no answer from "
                "the coordinator (it finds the failure after its heartbeat timeout)",
                rank,
                exit_code,
            )
            return
        public = view.ranks.get(rank)
        report = FailureReport(
            generation=public.generation if public is not None else view.generation,
            exit_code=max(-255, min(255, exit_code)),
            detail=f"seen by the checkflow agent (exit code {exit_code})",
            seconds_ago=max(0.0, time.monotonic() - seen_at),
        )
        path = paths.path(paths.FAILURE, job=self.job, rank=rank)
        try:
            self._channel.call("POST", path, report, RankPublic)
            logger.warning(
                "checkflow: reported the crash of rank %d (exit code %s, generation %d) to %s",
                rank,
                report.exit_code,
                report.generation,
                self._channel.failover.current,
            )
        except CoordinatorUnavailable as e:
            self._note_unreachable(e)
        except httpx.HTTPStatusError as e:
            if e.response.status_code in (404, 405) and not self._no_failure_route:
                self._no_failure_route = True
                logger.warning(
                    "coordinator %s did not take the failure report of rank %d (%s); an "
                    "older coordinator detects the failure after its heartbeat timeout",
                    self.url,
                    rank,
                    why(e),
                )
            elif e.response.status_code not in (404, 405):
                logger.warning(
                    "coordinator refused the failure report of rank %d: %s", rank, why(e)
                )
        except Exception:
            logger.exception("coordinator: reporting rank %d failed", rank)

    def _send_stop(self, error: BaseException) -> None:
        view = self.refresh()  # the job's generation now: its crash reports started one
        if view is None:
            logger.warning("checkflow: the coordinator was not told that job %s stopped", self.job)
            return
        body = stop_request(error, view.generation)
        try:
            self._channel.call("POST", paths.path(paths.STOP, job=self.job), body, JobPublic)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            logger.warning("coordinator: reporting that job %s stopped failed: %s", self.job, e)

    def _note_unreachable(self, error: Exception) -> None:
        if not self._unreachable:
            self._unreachable = True
            logger.warning(
                "coordinator %s unreachable (%s); the agent keeps the job running and retries",
                self.url,
                error,
            )

    def _back_online(self) -> None:
        if self._unreachable:
            self._unreachable = False
            logger.warning("coordinator %s reachable again", self.url)


@contextmanager
def watching(watch: CoordinatorWatch | None) -> Iterator[None]:
    """Start ``watch`` (None: no coordinator) for the block; an exception that ends the
    block ends the launcher, and is reported to it (:meth:`CoordinatorWatch.report_stop`)
    before it propagates. The caller still closes the watch."""
    if watch is None:
        yield
        return
    watch.start()
    try:
        yield
    except BaseException as e:
        watch.report_stop(e)
        raise


def stop_request(error: BaseException, generation: int) -> StopRequest:
    """What the launcher tells the coordinator when ``error`` ends it: a signal (Ctrl-C,
    SIGTERM: torch's ``SignalException``, or ``KeyboardInterrupt``) stops the job; any
    other end (restarts used up: ``ChildFailedError``; workers that cannot form their
    world) is recovery giving up: the job failed."""
    signal = type(error).__name__ in ("SignalException", "KeyboardInterrupt")
    reason = StopReason.INTERRUPTED if signal else StopReason.GAVE_UP
    detail = f"{type(error).__name__}: {error}"[:1024]
    return StopRequest(generation=generation, reason=reason, detail=detail)
