"""The checkpoint schedule a job's ranks share: which steps are checkpoint steps.

The coordinator sends it in every reply and the ranks evaluate it locally, so that every
rank picks the same steps without asking. When the interval changes, the new one starts at
``anchor``, far enough ahead that every rank has heard of it before getting there; below
``anchor`` the previous schedule still applies, so a rank that has not seen the change yet
agrees with one that has.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from checkflow.protocol.fields import MAX_INT


class Schedule(BaseModel):
    """Checkpoint steps: ``anchor + k * interval`` from ``anchor`` on; below ``anchor``,
    ``previous_anchor + k * previous_interval`` (when set)."""

    model_config = ConfigDict(frozen=True)

    anchor: int = Field(ge=0, le=MAX_INT)
    interval: int = Field(ge=1, le=MAX_INT)
    previous_anchor: int | None = Field(default=None, ge=0, le=MAX_INT)
    previous_interval: int | None = Field(default=None, ge=1, le=MAX_INT)

    def next_after(self, step: int) -> int:
        """The first checkpoint step strictly after ``step``."""
        if self.previous_anchor is not None and self.previous_interval and step < self.anchor:
            candidate = _next_on(self.previous_anchor, self.previous_interval, step)
            if candidate < self.anchor:
                return candidate
        return _next_on(self.anchor, self.interval, step)

    def is_checkpoint(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step."""
        return self.next_after(step - 1) == step

    def first_at_or_after(self, step: int) -> int:
        """The first step of the current schedule (ignoring the previous one) >= ``step``."""
        return _next_on(self.anchor, self.interval, step - 1)

    def changed_to(self, interval: int, anchor: int) -> Schedule:
        """This schedule moving to ``interval`` from ``anchor`` on (this one applies below)."""
        return Schedule(
            anchor=anchor,
            interval=interval,
            previous_anchor=self.anchor,
            previous_interval=self.interval,
        )


def _next_on(anchor: int, interval: int, step: int) -> int:
    """The first step of ``anchor + k * interval`` (k >= 0) strictly after ``step``."""
    if step < anchor:
        return anchor
    return anchor + ((step - anchor) // interval + 1) * interval
