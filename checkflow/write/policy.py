"""Save decisions: is step N due for a checkpoint? Small policy objects, pure, no threads.

Like Orbax's save-decision policies, each object answers one question, ``is_due``; the
``Checkpointer`` asks its policy after every step instead of branching over its options.
How an interval is chosen from measurements (CheckFreq's profile -> interval) is
``checkflow.policy``, shared with the coordinator; this module only applies an interval.

Every rank of a job must get the same answer for the same step, or one rank's part of a
checkpoint is missing and the step never commits: each policy says how it ensures that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from checkflow.policy import FrequencyTuner


class SavePolicy(ABC):
    """Decides, on the training thread after each completed step, whether to checkpoint."""

    @abstractmethod
    def is_due(self, step: int, last_checkpoint_step: int) -> bool:
        """True when a checkpoint of ``step`` is due.

        Args:
            step: completed training steps, this one included.
            last_checkpoint_step: the step of the newest checkpoint taken or restored (0
                when there is none).
        """


@dataclass(frozen=True, slots=True)
class FixedInterval(SavePolicy):
    """Every ``every`` steps counted from step 0, so the same steps on every rank and across
    restarts (a job restored at step 7 with ``every=5`` checkpoints at 10, not 12)."""

    every: int
    """Steps between checkpoints; at least 1."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive int, got {self.every!r}")

    def is_due(self, step: int, last_checkpoint_step: int) -> bool:
        return step % self.every == 0


@dataclass(slots=True)
class AutoInterval(SavePolicy):
    """``every="auto"``: due once the tuned interval has passed since the last checkpoint.

    Ranks measure different times, so their tuners may disagree; with several ranks
    ``agreed_interval`` returns rank 0's interval as of the last cross-rank agreement and
    every rank applies that one. Before the first agreement the local tuner's interval
    (the same warm-up interval on every rank) is used.
    """

    tuner: FrequencyTuner
    """Picks the interval from measured step and checkpoint costs."""
    agreed_interval: Callable[[], int | None] = lambda: None
    """Rank 0's interval (``RankSync.interval``), or None (one process, or not agreed yet)."""

    @property
    def interval(self) -> int:
        """The interval in steps this policy applies now."""
        return self.agreed_interval() or self.tuner.interval

    def is_due(self, step: int, last_checkpoint_step: int) -> bool:
        return step - last_checkpoint_step >= self.interval


@dataclass(slots=True)
class CoordinatorSchedule(SavePolicy):
    """The coordinator's schedule, one for every rank of the job (``every="auto"`` with a
    coordinator).

    Without a reply yet, or while the coordinator is down, ``fallback`` decides, so that
    training never waits on the network.
    """

    ask: Callable[[int], bool | None]
    """The coordinator's answer for a step (``CoordinatorClient.should_checkpoint``), or
    None when it has given no schedule."""
    fallback: SavePolicy
    """Decides when the coordinator has no answer."""

    def is_due(self, step: int, last_checkpoint_step: int) -> bool:
        decision = self.ask(step)
        if decision is None:
            return self.fallback.is_due(step, last_checkpoint_step)
        return bool(decision)


def save_policy(
    every: int | str,
    tuner: FrequencyTuner | None,
    *,
    agreed_interval: Callable[[], int | None] = lambda: None,
    ask: Callable[[int], bool | None] | None = None,
) -> SavePolicy:
    """The policy for a ``Checkpointer``'s ``every``.

    A fixed ``every`` is the same on every rank already, so it needs neither the agreed
    interval nor the coordinator. ``every="auto"`` applies ``tuner``'s interval (rank 0's
    once agreed) and, with a coordinator (``ask``), the coordinator's schedule first.

    Raises:
        ValueError: ``every="auto"`` without a tuner.
    """
    if every != "auto":
        return FixedInterval(int(every))
    if tuner is None:
        raise ValueError('every="auto" needs a FrequencyTuner')
    policy: SavePolicy = AutoInterval(tuner, agreed_interval=agreed_interval)
    if ask is not None:
        policy = CoordinatorSchedule(ask, fallback=policy)
    return policy
