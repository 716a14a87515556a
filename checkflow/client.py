"""HTTP client of the checkflow coordinator, and the in-rank watchdog.

One :class:`CoordinatorClient` per rank. It registers, sends heartbeats from a daemon
thread, reports persisted parts, and learns the checkpoint schedule from the replies. When
the coordinator answers ``abort`` (the job moved to a new generation because some rank
failed) it logs why and ends the process with :data:`ABORT_EXIT_CODE`, so that torchrun or
Kubernetes restarts the whole group, which then registers and restores.

Training never waits on the network: :meth:`CoordinatorClient.report_progress` only stores
values for the next heartbeat; when the coordinator is down the rank keeps its last
schedule, retries with backoff, logs once, and catches up when it is back.

Run ``python -m checkflow.client --help`` for a simulated rank (used by the tests and for
trying a coordinator out without torch).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

ABORT_EXIT_CODE = 75
"""Exit status of a rank told to abort (EX_TEMPFAIL: restart the group and try again)."""
MAX_BACKOFF_S = 4.0
"""Longest wait between retries while the coordinator is unreachable. Below its default
heartbeat timeout (10 s) so a restarted coordinator hears from every rank within the fresh
grace period it gives them."""

_jitter = random.Random()
"""The heartbeat's backoff jitter has its own generator: drawing from the global one on this
thread would shift the training's ``random`` sequence (which checkpoints save and restore)
by however many retries happened, so no run would repeat an uninterrupted one."""


@dataclass(frozen=True, slots=True)
class Registration:
    """What a rank learns when it registers."""

    generation: int
    """The job's generation; sent with every later request."""
    restore_step: int | None
    """The newest checkpoint every rank committed; None: start from scratch."""
    interval: int
    """Checkpoint every this many steps."""
    next_checkpoint_step: int | None
    """The job's next checkpoint step."""


@dataclass(frozen=True, slots=True)
class CheckpointSchedule:
    """Checkpoint steps ``anchor + k * interval`` (k >= 0); below ``anchor`` the previous
    schedule applies. Every rank of a job gets the same schedule, so all pick the same steps
    even when an interval change reaches them at different times."""

    anchor: int
    interval: int
    previous_anchor: int | None = None
    previous_interval: int | None = None

    def is_checkpoint(self, step: int) -> bool:
        if step >= self.anchor:
            return (step - self.anchor) % self.interval == 0
        if self.previous_anchor is not None and self.previous_interval:
            return step >= self.previous_anchor and (
                (step - self.previous_anchor) % self.previous_interval == 0
            )
        return False

    def next_after(self, step: int) -> int:
        if self.previous_anchor is not None and self.previous_interval and step < self.anchor:
            candidate = _next_on(self.previous_anchor, self.previous_interval, step)
            if candidate < self.anchor:
                return candidate
        return _next_on(self.anchor, self.interval, step)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CheckpointSchedule:
        return cls(
            anchor=raw["anchor"],
            interval=raw["interval"],
            previous_anchor=raw.get("previous_anchor"),
            previous_interval=raw.get("previous_interval"),
        )


class CoordinatorUnavailable(RuntimeError):
    """The coordinator could not be reached (network error, timeout or 5xx)."""


class CoordinatorClient:
    """One rank's link to the coordinator.

    Call order: :meth:`register` once (before restoring), :meth:`start`, then
    :meth:`report_progress` after every step, :meth:`should_checkpoint` to decide,
    :meth:`report_persisted` from the persist thread, :meth:`report_committed` after the
    commit, and :meth:`close` at the end.

    Args:
        url: Base URL of the coordinator, e.g. ``http://coord:8470``.
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
        on_abort: Called with the reason when the coordinator says ``abort``. Default:
            log an error line and ``os._exit(ABORT_EXIT_CODE)``.
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
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.storage_uri = storage_uri
        self.max_overhead = max_overhead
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_abort = on_abort or self._exit_on_abort
        self.instance = uuid.uuid4().hex
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Two connections: the heartbeat thread must never queue behind a persist report.
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self._hb_http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self._http_lock = threading.Lock()
        self._generation: int | None = None
        self._schedule: CheckpointSchedule | None = None
        self._progress: tuple[int, float | None, float | None, float | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unreachable = False
        self._aborted = False

    # --- public API ---------------------------------------------------------------------
    def register(self) -> Registration | None:
        """Create the job if needed and register this rank.

        Returns:
            The registration, or None when the coordinator is unreachable or refuses
            (logged once; the heartbeat thread keeps trying to register later).
        """
        try:
            return self._register(self._http)
        except CoordinatorUnavailable as e:
            self._note_unreachable(e)
            return None
        except httpx.HTTPStatusError as e:
            logger.error("coordinator refused registration of rank %d: %s", self.rank, _why(e))
            return None

    def start(self) -> None:
        """Start the heartbeat thread (a daemon: it never keeps the process alive)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"checkflow-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()

    def report_progress(
        self,
        step: int,
        iteration_s: float | None = None,
        stall_s: float | None = None,
        persist_s: float | None = None,
    ) -> None:
        """Latest step and measurements, sent with the next heartbeat. Never blocks."""
        self._progress = (step, iteration_s, stall_s, persist_s)  # one atomic assignment

    @property
    def generation(self) -> int | None:
        return self._generation

    @property
    def schedule(self) -> CheckpointSchedule | None:
        """The job's checkpoint schedule from the latest reply (None before any reply)."""
        return self._schedule

    @property
    def interval(self) -> int | None:
        s = self._schedule
        return None if s is None else s.interval

    @property
    def next_checkpoint_step(self) -> int | None:
        """The first checkpoint step after the last step given to :meth:`report_progress`."""
        s, p = self._schedule, self._progress
        if s is None:
            return None
        return s.next_after(p[0] if p is not None else -1)

    def should_checkpoint(self, step: int) -> bool | None:
        """Whether ``step`` is a checkpoint step of the job; None before any reply."""
        s = self._schedule
        return None if s is None else s.is_checkpoint(step)

    def report_persisted(
        self, step: int, nbytes: int, duration_s: float, manifest_path: str
    ) -> bool | None:
        """This rank persisted its part of ``step``; call from the persist thread.

        Returns:
            True when this rank must write the commit (every rank has persisted and this
            one completed the set), False when it must not (others still persisting, or the
            checkpoint belongs to a generation that ended), None when the coordinator is
            unreachable (the caller falls back to its own agreement).
        """
        if self._generation is None:
            return None
        body = {
            "generation": self._generation,
            "nbytes": nbytes,
            "duration_s": duration_s,
            "manifest_path": manifest_path,
        }
        path = f"/v1/jobs/{self.job}/checkpoints/{step}/ranks/{self.rank}"
        try:
            reply = self._request(self._http, "PUT", path, body, lock=True)
        except CoordinatorUnavailable as e:
            self._note_unreachable(e)
            return None
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 409:
                logger.warning("checkpoint %d: coordinator says %s", step, _why(e))
                return False
            logger.warning("checkpoint %d: coordinator refused the report: %s", step, _why(e))
            return None
        return bool(reply["must_commit"])

    def report_committed(self, step: int) -> None:
        """The global manifest of ``step`` is written (this rank committed it)."""
        path = f"/v1/jobs/{self.job}/checkpoints/{step}/commit"
        try:
            self._request(self._http, "POST", path, {"rank": self.rank}, lock=True)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            # Not fatal: the coordinator also learns commits by listing storage.
            logger.warning("could not report commit of step %d: %s", step, e)

    def finish(self) -> None:
        """Training ended normally: the coordinator stops watching this rank.

        Call it before :meth:`close` when the training loop completed; without it, the
        rank's silence after exit is declared a failure after the heartbeat timeout.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._generation is None:
            return
        path = f"/v1/jobs/{self.job}/ranks/{self.rank}/finish"
        try:
            body: dict[str, Any] = {"generation": self._generation}
            if self._progress is not None:
                body["step"] = self._progress[0]
            self._request(self._http, "POST", path, body, lock=True)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            logger.warning("could not tell the coordinator that rank %d finished: %s", self.rank, e)

    def close(self) -> None:
        """Stop the heartbeat thread and close connections."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._http.close()
        self._hb_http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------
    def _register(self, http: httpx.Client) -> Registration:
        job = {
            "name": self.job,
            "world_size": self.world_size,
            "max_overhead": self.max_overhead,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
        }
        if self.storage_uri:
            job["storage_uri"] = self.storage_uri
        self._request(http, "POST", "/v1/jobs", job)
        body = {"instance": self.instance, "node": socket.gethostname()[:256]}
        reply = self._request(http, "POST", f"/v1/jobs/{self.job}/ranks/{self.rank}/register", body)
        self._generation = reply["generation"]
        self._schedule = CheckpointSchedule.from_json(reply["schedule"])
        self._back_online()
        logger.info(
            "rank %d registered with coordinator %s: generation %d, restore step %s",
            self.rank,
            self.url,
            reply["generation"],
            reply["restore_step"],
        )
        return Registration(
            generation=reply["generation"],
            restore_step=reply["restore_step"],
            interval=reply["interval"],
            next_checkpoint_step=reply["next_checkpoint_step"],
        )

    def _heartbeat_loop(self) -> None:
        delay = self.heartbeat_interval_s
        while not self._stop.wait(delay):
            try:
                self._beat()
                delay = self.heartbeat_interval_s
            except CoordinatorUnavailable as e:
                self._note_unreachable(e)
                # Backoff with jitter so that thousands of ranks don't return in lockstep.
                delay = min(MAX_BACKOFF_S, max(delay, self.heartbeat_interval_s) * 2)
                delay *= _jitter.uniform(0.75, 1.0)
            except Exception:
                # The watchdog must survive anything; training goes on without it.
                logger.exception("heartbeat of rank %d failed", self.rank)
                delay = self.heartbeat_interval_s
            if self._aborted:
                return

    def _beat(self) -> None:
        if self._generation is None:
            try:
                self._register(self._hb_http)
            except httpx.HTTPStatusError as e:
                logger.error("coordinator refused registration: %s", _why(e))
            return
        step, iteration_s, stall_s, persist_s = self._progress or (0, None, None, None)
        body: dict[str, Any] = {"generation": self._generation, "step": step}
        for key, value in (
            ("iteration_s", iteration_s),
            ("stall_s", stall_s),
            ("persist_s", persist_s),
        ):
            if value is not None and value >= 0:
                body[key] = float(value)
        path = f"/v1/jobs/{self.job}/ranks/{self.rank}/heartbeat"
        try:
            reply = self._request(self._hb_http, "POST", path, body)
        except httpx.HTTPStatusError as e:
            code = e.response.status_code
            if code == 409:
                self._abort(f"coordinator does not know generation {self._generation}: {_why(e)}")
            elif code == 404:
                # The coordinator lost this job (new database): register it again.
                logger.warning("coordinator does not know job %s; registering again", self.job)
                self._generation = None
            else:
                logger.error("heartbeat refused: %s", _why(e))
            return
        self._back_online()
        self._schedule = CheckpointSchedule.from_json(reply["schedule"])
        if reply["action"] == "abort":
            self._abort(
                f"job {self.job} moved to generation {reply['generation']} (this rank is in "
                f"generation {self._generation}): another rank failed or a rollback was asked"
            )

    def _request(
        self,
        http: httpx.Client,
        method: str,
        path: str,
        body: dict[str, Any],
        *,
        lock: bool = False,
    ) -> dict[str, Any]:
        try:
            if lock:
                with self._http_lock:
                    response = http.request(method, path, json=body)
            else:
                response = http.request(method, path, json=body)
        except httpx.TransportError as e:
            raise CoordinatorUnavailable(f"{type(e).__name__}: {e}") from e
        if response.status_code >= 500:
            raise CoordinatorUnavailable(f"HTTP {response.status_code}")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

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

    def _note_unreachable(self, error: Exception) -> None:
        if not self._unreachable:
            self._unreachable = True
            interval = self.interval
            logger.warning(
                "coordinator %s unreachable (%s); rank %d keeps training%s and retries",
                self.url,
                error,
                self.rank,
                f" with interval {interval}" if interval is not None else "",
            )

    def _back_online(self) -> None:
        if self._unreachable:
            self._unreachable = False
            logger.warning("coordinator %s reachable again (rank %d)", self.url, self.rank)


def _next_on(anchor: int, interval: int, step: int) -> int:
    if step < anchor:
        return anchor
    return anchor + ((step - anchor) // interval + 1) * interval


def _why(error: httpx.HTTPStatusError) -> str:
    try:
        detail = error.response.json().get("detail")
    except ValueError:
        detail = error.response.text
    return f"HTTP {error.response.status_code}: {detail}"


def simulate_rank(argv: list[str] | None = None) -> int:
    """A rank without torch: steps, heartbeats, checkpoints on the coordinator's schedule.

    Prints one JSON line per event (registered, checkpoint, done) to stdout; exits with
    :data:`ABORT_EXIT_CODE` when told to abort. Used by the tests as a real client process.
    """
    import argparse
    import json
    import sys
    import time

    p = argparse.ArgumentParser(prog="python -m checkflow.client")
    p.add_argument("--url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--token")
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--stall", type=float, default=0.005, help="reported snapshot stall")
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--crash-at", type=int, help="os._exit(1) when reaching this step")
    p.add_argument("--hang-at", type=int, help="stop heartbeating (hang) at this step")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s rank %(process)d %(levelname)s %(message)s",
    )

    def emit(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, "rank": args.rank, **fields}), flush=True)

    client = CoordinatorClient(
        args.url,
        args.job,
        args.rank,
        args.world_size,
        token=args.token,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )
    reg = client.register()
    start = (reg.restore_step or 0) if reg else 0
    emit("registered", generation=reg.generation if reg else None, start=start)
    client.start()
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_time)
        if step == args.crash_at:
            os._exit(1)
        if step == args.hang_at:
            client._stop.set()  # the heartbeat thread dies with the "hung" process
            time.sleep(3600)
        client.report_progress(step, args.step_time, args.stall, args.step_time)
        if client.should_checkpoint(step):
            must_commit = client.report_persisted(step, 1000, args.step_time, f"step-{step}")
            if must_commit:
                client.report_committed(step)
            emit("checkpoint", step=step, must_commit=must_commit, generation=client.generation)
    emit("done", step=args.steps, generation=client.generation)
    client.finish()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(simulate_rank())
