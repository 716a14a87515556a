"""When to checkpoint: CheckFreq's profile -> interval, bounded by Young/Daly. Pure; no I/O.

Shared by the runtime (``every="auto"``) and the coordinator (one interval for a whole job).

The cost of one checkpoint is the training time it takes away: the blocking stall (the
snapshot start plus any wait in the optimizer pre-hook) and the slow-down of the steps that
run while the background persist competes for CPU and memory bandwidth. With a step of
``t`` seconds and a checkpoint every ``k`` steps, the overhead is ``cost / (k * t)``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

DEFAULT_MAX_OVERHEAD = 0.035

PERSIST_HEADROOM = 1.25
"""The interval leaves each persist this factor of its measured time: persists vary, and
one that outlasts two intervals makes training wait for a host buffer set."""


@dataclass(kw_only=True, slots=True)
class Profile:
    """What a checkpoint costs, as measured (medians over recent observations)."""

    iteration_s: float
    """Duration of one training step without a checkpoint in flight."""
    cost_s: float
    """Training time lost per checkpoint (stall + slow-down while persisting)."""
    persist_s: float
    """Wall time from snapshot to commit, in the background."""


def choose_interval(
    profile: Profile,
    *,
    max_overhead: float = DEFAULT_MAX_OVERHEAD,
    mtbf_s: float | None = None,
    min_interval: int = 1,
    max_interval: int = 1_000_000,
) -> int:
    """The checkpoint interval in steps.

    The smallest ``k`` whose overhead ``cost / (k * iteration)`` stays under ``max_overhead``
    and that lets each persist finish, with ``PERSIST_HEADROOM`` to spare, before the next
    checkpoint is due (so training never waits for a host buffer set). When failures were
    observed (``mtbf_s``), the interval is also bounded above by the Young/Daly optimum
    ``sqrt(2 * cost * MTBF)``: with frequent failures, lost work costs more than checkpoints.
    It never goes below what the persist needs, since a faster cadence only queues work.

    Raises:
        ValueError: ``max_overhead`` is not in (0, 1] or the bounds are inverted.
    """
    if not 0 < max_overhead <= 1:
        raise ValueError(f"max_overhead must be in (0, 1], got {max_overhead}")
    if min_interval < 1 or max_interval < min_interval:
        raise ValueError(f"bad interval bounds [{min_interval}, {max_interval}]")
    step = profile.iteration_s
    if step <= 0 or not math.isfinite(step):
        return min_interval
    cost = max(0.0, profile.cost_s)
    k_budget = math.ceil(cost / (max_overhead * step) - 1e-9) if cost > 0 else 1
    k_persist = math.ceil(PERSIST_HEADROOM * max(0.0, profile.persist_s) / step - 1e-9)
    k = k_budget
    if mtbf_s is not None and mtbf_s > 0 and cost > 0:
        k_daly = max(1, round(math.sqrt(2 * cost * mtbf_s) / step))
        k = min(k, k_daly)
    k = max(k, k_persist, min_interval)
    return min(k, max_interval)


@dataclass(kw_only=True, slots=True)
class FrequencyTuner:
    """Online CheckFreq policy: feed it measurements, read ``interval``.

    Starts at ``warmup_interval`` so that the first checkpoints can be measured, then picks
    the interval from the medians of the last ``window`` observations and keeps adapting
    when iteration time changes.
    """

    max_overhead: float = DEFAULT_MAX_OVERHEAD
    """Fraction of training time checkpoints may take."""
    warmup_interval: int = 10
    """Interval used until a checkpoint has been measured."""
    window: int = 50
    """How many recent observations the medians use."""
    min_interval: int = 1
    max_interval: int = 1_000_000
    interval: int = 0
    """The current interval (``warmup_interval`` until measured)."""
    _iterations: deque[float] = field(default_factory=deque)
    _costs: deque[float] = field(default_factory=deque)
    _persists: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not 0 < self.max_overhead <= 1:
            raise ValueError(f"max_overhead must be in (0, 1], got {self.max_overhead}")
        if self.warmup_interval < 1:
            raise ValueError("warmup_interval must be >= 1")
        if not self.interval:
            self.interval = self.warmup_interval

    def observe_iteration(self, seconds: float) -> None:
        """One training step that ran with no checkpoint in flight."""
        _push(self._iterations, seconds, self.window)

    def observe_checkpoint(self, cost_s: float, persist_s: float) -> None:
        """One finished checkpoint: its training cost and its persist time."""
        _push(self._costs, cost_s, self.window)
        _push(self._persists, persist_s, self.window)

    @property
    def measured(self) -> int:
        """Checkpoints measured so far (within the window)."""
        return len(self._costs)

    @property
    def iteration_s(self) -> float | None:
        """Median duration of a step with no checkpoint in flight, once observed."""
        return statistics.median(self._iterations) if self._iterations else None

    @property
    def profile(self) -> Profile | None:
        if not self._iterations or not self._costs:
            return None
        return Profile(
            iteration_s=statistics.median(self._iterations),
            cost_s=statistics.median(self._costs),
            persist_s=statistics.median(self._persists),
        )

    def update(self, *, mtbf_s: float | None = None) -> bool:
        """Recompute the interval; True when it changed."""
        profile = self.profile
        if profile is None:
            return False
        new = choose_interval(
            profile,
            max_overhead=self.max_overhead,
            mtbf_s=mtbf_s,
            min_interval=self.min_interval,
            max_interval=self.max_interval,
        )
        changed = new != self.interval
        self.interval = new
        return changed


def _push(values: deque[float], value: float, window: int) -> None:
    if math.isfinite(value) and value >= 0:
        values.append(value)
        while len(values) > window:
            values.popleft()
