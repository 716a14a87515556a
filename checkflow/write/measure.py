"""What a checkpoint costs the training loop, measured for ``every="auto"`` and the coordinator.

The cost of a checkpoint is its blocking stall (the snapshot start plus any wait in the
optimizer pre-hook) and the slow-down of the steps that run while its persist competes for
CPU and memory bandwidth. One checkpoint is measured at a time, from snapshot to commit;
steps with no measurement in flight give the baseline step time.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from checkflow.interval import FrequencyTuner


@dataclass(slots=True)
class _Measurement:
    step: int
    stall_s: float
    future: Future[int]
    slowdown_s: float = 0.0
    persist_s: float | None = None


class CostMeter:
    """Measures checkpoints and step times, and feeds them to ``tuner``.

    The training thread calls ``checkpoint_started``, ``optimizer_waited`` and
    ``step_ended``; the persist thread calls ``persisted``.

    Args:
        tuner: the ``every="auto"`` tuner; None with a fixed interval (then only the last
            cost and persist time are kept, for the coordinator).
    """

    def __init__(self, tuner: FrequencyTuner | None) -> None:
        self.tuner = tuner
        self.last_cost_s: float | None = None
        """Training time the newest measured checkpoint cost (reported to the coordinator)."""
        self.last_persist_s: float | None = None
        """Wall time of the newest persist (reported to the coordinator)."""
        self._current: _Measurement | None = None

    def checkpoint_started(self, step: int, stall_s: float, future: Future[int]) -> None:
        """A snapshot of ``step`` was taken, blocking training for ``stall_s``."""
        m = self._current
        if m is None or (m.future.done() and m.persist_s is None):
            # One checkpoint is measured at a time, from snapshot to commit (or failure).
            # Replacing it with a newer one while it persists (a second buffer set makes
            # that possible) would never let a slow persist be measured, and every="auto"
            # would keep its warm-up interval and wait on storage for ever.
            self._current = _Measurement(step=step, stall_s=stall_s, future=future)

    def optimizer_waited(self, step: int, waited_s: float) -> None:
        """The optimizer pre-hook waited ``waited_s`` for the snapshot of ``step``."""
        if self._current is not None and self._current.step == step:
            self._current.stall_s += waited_s

    def persisted(self, step: int, duration_s: float, last_stall_s: float | None) -> None:
        """This rank stored ``step`` in ``duration_s`` (persist thread); ``last_stall_s`` is
        the newest checkpoint's stall, the cost reported when nothing is tuned."""
        self.last_persist_s = duration_s
        if self.tuner is None and last_stall_s is not None:
            self.last_cost_s = last_stall_s
        m = self._current
        if m is not None and m.step == step:
            m.persist_s = duration_s

    def step_ended(self, dt: float) -> bool:
        """One step took ``dt`` seconds. True when this completed a measurement and fed it
        to the tuner, whose interval the caller then updates."""
        if self.tuner is None:
            return False
        m = self._current
        if m is None:
            self.tuner.observe_iteration(dt)
            return False
        baseline = self.tuner.iteration_s
        if baseline is not None:
            m.slowdown_s += max(0.0, dt - baseline)
        if m.persist_s is None:
            return False
        self.last_cost_s, self.last_persist_s = m.stall_s + m.slowdown_s, m.persist_s
        self.tuner.observe_checkpoint(m.stall_s + m.slowdown_s, m.persist_s)
        self._current = None
        return True

    def reported(self, dt: float) -> tuple[float, float | None, float | None]:
        """What the coordinator is told after a step of ``dt`` seconds: step time, cost
        and persist time. The tuner's medians once it has measured a checkpoint: the job's
        one interval is computed from them, and single steps and checkpoints vary too much
        (a job's shown interval jumped 13, 66, 22 from one to the next)."""
        profile = self.tuner.profile if self.tuner is not None else None
        if profile is None:
            return dt, self.last_cost_s, self.last_persist_s
        return profile.iteration_s, profile.cost_s, profile.persist_s

    def retune(self, log: logging.Logger, step: int | None = None) -> int:
        """After :meth:`step_ended` returned True: the tuner's interval, updated from the
        measurements so far; a change is logged to ``log`` (the ``Checkpointer``'s) with
        the training ``step`` it happened at."""
        tuner = self.tuner
        assert tuner is not None
        old = tuner.interval
        if tuner.update():
            p = tuner.profile
            assert p is not None
            log.info(
                "checkpoint interval now %d steps (was %d; at step %s after %d measured "
                "checkpoints: step %.4fs, cost %.4fs, persist %.4fs, budget %.1f%%)",
                tuner.interval,
                old,
                "?" if step is None else step,
                tuner.measured,
                p.iteration_s,
                p.cost_s,
                p.persist_s,
                100 * tuner.max_overhead,
            )
        return tuner.interval
