"""The checkpoint schedule of a job, as the coordinator shows it and tells the ranks.

A fixed ``every=N`` checkpoints at the multiples of N (``anchor`` 0). With ``every="auto"``
a rank counts its interval from its newest checkpoint, so ``anchor`` is the newest
checkpoint step the coordinator knows of (or the restore point), and a new interval counts
from there: the ranks adopt it at their next checkpoint at the latest (with several ranks,
rank 0's view of it, agreed by all at that checkpoint), never from a step far ahead.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from checkflow.protocol.fields import MAX_INT
from checkflow.protocol.status import IntervalMode


class Schedule(BaseModel):
    """Checkpoint steps: ``anchor + k * interval`` for k >= 1."""

    model_config = ConfigDict(frozen=True)

    anchor: int = Field(ge=0, le=MAX_INT, description="The step the interval counts from.")
    interval: int = Field(ge=1, le=MAX_INT)
    mode: IntervalMode = Field(
        default=IntervalMode.WARMUP,
        description='fixed: the ranks\' every=N; warmup: every="auto" before the coordinator '
        "measured it (each rank applies its own); tuned: computed by the coordinator.",
    )

    def next_after(self, step: int) -> int:
        """The first checkpoint step strictly after ``step`` (and after ``anchor``)."""
        done = max(0, step - self.anchor)
        return self.anchor + (done // self.interval + 1) * self.interval

    def is_checkpoint(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step."""
        return step > self.anchor and (step - self.anchor) % self.interval == 0

    def counted_from(self, step: int) -> Schedule:
        """This schedule counted from checkpoint ``step`` on (``every="auto"``: the ranks
        count from their newest checkpoint); a fixed one keeps its multiples."""
        if self.mode == IntervalMode.FIXED or step <= self.anchor:
            return self
        return self.model_copy(update={"anchor": step})
