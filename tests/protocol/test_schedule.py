"""The one checkpoint schedule that the coordinator and every rank evaluate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from checkflow.protocol import Schedule


def brute_force_steps(s: Schedule, upto: int) -> list[int]:
    """Checkpoint steps by the definition: the previous schedule below ``anchor``, the
    current one from ``anchor`` on."""
    steps = set(range(s.anchor, upto, s.interval))
    if s.previous_anchor is not None and s.previous_interval is not None:
        steps |= {k for k in range(s.previous_anchor, upto, s.previous_interval) if k < s.anchor}
    return sorted(steps)


schedules = st.builds(
    Schedule,
    anchor=st.integers(0, 300),
    interval=st.integers(1, 40),
    previous_anchor=st.none() | st.integers(0, 300),
    previous_interval=st.none() | st.integers(1, 40),
)


def test_a_changed_interval_keeps_the_old_one_below_its_anchor() -> None:
    s = Schedule(anchor=110, interval=20, previous_anchor=10, previous_interval=10)
    assert [k for k in range(160) if s.is_checkpoint(k)] == [*range(10, 120, 10), 130, 150]
    assert (s.next_after(95), s.next_after(100), s.next_after(110)) == (100, 110, 130)
    assert s.first_at_or_after(111) == 130 and s.first_at_or_after(110) == 110


def test_changed_to_moves_the_current_schedule_into_previous() -> None:
    s = Schedule(anchor=10, interval=10).changed_to(20, anchor=110)
    assert s == Schedule(anchor=110, interval=20, previous_anchor=10, previous_interval=10)


@given(schedules)
def test_next_after_and_is_checkpoint_agree_with_the_definition(s: Schedule) -> None:
    expected = brute_force_steps(s, 1000)
    assert [k for k in range(900) if s.is_checkpoint(k)] == [k for k in expected if k < 900]
    for step in range(-1, 800, 7):
        assert s.next_after(step) == min(k for k in expected if k > step)


def test_a_zero_or_negative_interval_is_refused_when_parsed() -> None:
    with pytest.raises(ValidationError):
        Schedule.model_validate({"anchor": 10, "interval": 0})
    with pytest.raises(ValidationError):
        Schedule.model_validate({"anchor": -1, "interval": 10})
