"""Save decisions: is step N due for a checkpoint? Small policy objects, pure, no threads.

Like Orbax's save-decision policies, each object answers one question, ``is_due``; the
``Checkpointer`` asks its policy after every step instead of branching over its options.
How an interval is chosen from measurements (CheckFreq's profile -> interval) is
``checkflow.interval``, shared with the coordinator; this module only applies an interval.

Every rank of a job must get the same answer for the same step, or one rank's part of a
checkpoint is missing and the step never commits: each policy says how it ensures that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from checkflow.interval import FrequencyTuner


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

    @property
    @abstractmethod
    def interval(self) -> int:
        """The interval in steps this policy applies now (``stats.interval``)."""

    @property
    def proposed(self) -> int | None:
        """The interval this rank proposes at the next cross-rank agreement (rank 0's is
        adopted by all); None: the policy needs no agreement."""
        return None


@dataclass(frozen=True, slots=True)
class FixedInterval(SavePolicy):
    """Every ``every`` steps counted from step 0, so the same steps on every rank and across
    restarts (a job restored at step 7 with ``every=5`` checkpoints at 10, not 12)."""

    every: int
    """Steps between checkpoints; at least 1."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive int, got {self.every!r}")

    @property
    def interval(self) -> int:
        return self.every

    def is_due(self, step: int, last_checkpoint_step: int) -> bool:
        return step % self.every == 0


def proposed_interval(*, tuned: int | None, local: int) -> int:
    """The interval a rank of an ``every="auto"`` job would apply on its own: the
    coordinator's once it computed one from the whole job's measurements (``tuned``), else
    this process's tuner's (``local``: its warm-up interval until a checkpoint is measured,
    which a coordinator does only a heartbeat or two later)."""
    return tuned if tuned is not None else local


def adopted_interval(*, proposed: int, local: int, agreed: int | None, shared: bool) -> int:
    """The interval an ``every="auto"`` rank applies now.

    One process applies what it ``proposed``: a new interval of the coordinator counts from
    the last checkpoint at once. Ranks of a job (``shared``) apply rank 0's proposal as of
    the last checkpoint, where every rank agreed on it (``agreed``): they all checkpoint at
    the same steps, and a change takes effect from the next due step, the next agreement.
    Before the first agreement they apply ``local``, the tuner's warm-up interval, the same
    on every rank (a tuner changes only once a checkpoint, so an agreement, happened).
    """
    if not shared:
        return proposed
    return agreed if agreed is not None else local


class Agreement(Protocol):
    """Where rank 0's proposal as of the last cross-rank agreement is read
    (``RankSync``)."""

    interval: int | None
    """Rank 0's proposed interval at the last agreement; None before the first."""


class Coordinator(Protocol):
    """Where the coordinator's interval for the job is read (``CoordinatorClient``)."""

    @property
    def tuned_interval(self) -> int | None:
        """The coordinator's interval once tuned from the job's measurements, else None."""


@dataclass(slots=True)
class AutoInterval(SavePolicy):
    """``every="auto"``: due once the adopted interval has passed since the last checkpoint.

    The interval is this process's tuner's, or the coordinator's once it tuned the job,
    adopted as :func:`adopted_interval` says; counting from the last checkpoint, a new one
    applies from the next due step at the latest, never from a step computed far ahead
    with the old one.
    """

    tuner: FrequencyTuner
    """Picks the interval from measured step and checkpoint costs."""
    agreement: Agreement | None = None
    """The cross-rank agreement of a job of several ranks; None for one process."""
    coordinator: Coordinator | None = None
    """The job's coordinator, if it has one."""

    @property
    def proposed(self) -> int:
        tuned = self.coordinator.tuned_interval if self.coordinator is not None else None
        return proposed_interval(tuned=tuned, local=self.tuner.interval)

    @property
    def interval(self) -> int:
        agreement = self.agreement
        return adopted_interval(
            proposed=self.proposed,
            local=self.tuner.interval,
            agreed=agreement.interval if agreement is not None else None,
            shared=agreement is not None,
        )

    def is_due(self, step: int, last_checkpoint_step: int) -> bool:
        return step - last_checkpoint_step >= self.interval


def save_policy(
    every: int | str,
    tuner: FrequencyTuner | None,
    agreement: Agreement | None = None,
    coordinator: Coordinator | None = None,
) -> SavePolicy:
    """The policy for a ``Checkpointer``'s ``every``.

    A fixed ``every`` is the same on every rank already, so it needs neither the agreement
    nor the coordinator. ``every="auto"`` applies ``tuner``'s interval, or the
    ``coordinator``'s once it tuned the job; with several ranks (``agreement``) rank 0's,
    as agreed at the last checkpoint.

    Raises:
        ValueError: ``every="auto"`` without a tuner.
    """
    if every != "auto":
        return FixedInterval(int(every))
    if tuner is None:
        raise ValueError('every="auto" needs a FrequencyTuner')
    return AutoInterval(tuner, agreement=agreement, coordinator=coordinator)
