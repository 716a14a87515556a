"""What a rank tells the coordinator about its training: its latest step and measurements,
and whether it is in a known pause.

The training thread writes, the heartbeat thread reads: :meth:`ProgressReport.update` is
one atomic assignment and never blocks; pauses are counted under a lock (they nest, and
may be entered from several threads, e.g. a blocking ``save()`` inside an eval pause).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from checkflow.protocol import MAX_SECONDS, Heartbeat


class ProgressReport:
    """The latest progress of one rank and its known pauses, for its next heartbeat."""

    def __init__(self) -> None:
        self._latest: tuple[int, float | None, float | None, float | None] | None = None
        self._lock = threading.Lock()
        self._depth = 0
        self._paused_since_beat = False

    def update(
        self,
        step: int,
        iteration_s: float | None = None,
        stall_s: float | None = None,
        persist_s: float | None = None,
    ) -> None:
        """The latest completed step and measurements. Never blocks."""
        self._latest = (step, iteration_s, stall_s, persist_s)  # one atomic assignment

    @property
    def step(self) -> int | None:
        """The latest step given to :meth:`update`; None before the first."""
        latest = self._latest
        return None if latest is None else latest[0]

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A known pause: heartbeats sent meanwhile say ``paused``, so the coordinator does
        not take the still step for a hang. Nestable."""
        with self._lock:
            self._depth += 1
            self._paused_since_beat = True
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                self._paused_since_beat = True

    def heartbeat(self, generation: int) -> Heartbeat:
        """The next heartbeat of ``generation``. It says ``paused`` when a pause was on at
        any time since the previous heartbeat (so the coordinator's progress clock starts
        when the pause ends, and a pause between two heartbeats counts). Measurements the
        coordinator would refuse are left out (a refused heartbeat is a missed one, and
        misses fail the job)."""
        with self._lock:
            paused = self._depth > 0 or self._paused_since_beat
            self._paused_since_beat = False
        step, iteration_s, stall_s, persist_s = self._latest or (0, None, None, None)
        return Heartbeat(
            generation=generation,
            step=max(0, step),
            iteration_s=_measurement(iteration_s),
            stall_s=_measurement(stall_s),
            persist_s=_measurement(persist_s),
            paused=paused,
        )


def _measurement(value: float | None) -> float | None:
    """``value`` if the coordinator accepts it as seconds, else None (not reported)."""
    if value is None or not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        return None
    return float(value)
