"""The checkpoint schedule the coordinator shows and the ranks' intervals count from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from checkflow.protocol import IntervalMode, Schedule


def brute_force_steps(s: Schedule, upto: int) -> list[int]:
    """Checkpoint steps by the definition: ``anchor + k * interval`` for k >= 1."""
    return list(range(s.anchor + s.interval, upto, s.interval))


schedules = st.builds(
    Schedule,
    anchor=st.integers(0, 300),
    interval=st.integers(1, 40),
    mode=st.sampled_from(list(IntervalMode)),
)


def test_a_fixed_every_checkpoints_at_its_multiples_even_after_another_step() -> None:
    s = Schedule(anchor=0, interval=20, mode=IntervalMode.FIXED)
    assert [k for k in range(70) if s.is_checkpoint(k)] == [20, 40, 60]
    assert s.counted_from(1060) == s  # a save() or a RAM step does not move multiples
    assert s.next_after(1060) == 1080 and s.next_after(1059) == 1060


def test_auto_counts_from_the_newest_checkpoint_and_never_goes_back() -> None:
    s = Schedule(anchor=20, interval=112, mode=IntervalMode.TUNED)
    assert s.counted_from(132) == Schedule(anchor=132, interval=112, mode=IntervalMode.TUNED)
    assert s.counted_from(10) == s
    # Below the anchor (the heartbeats lag behind the reported checkpoint): the one after.
    assert (s.next_after(5), s.next_after(20), s.next_after(131)) == (132, 132, 132)


@given(schedules)
def test_next_after_and_is_checkpoint_agree_with_the_definition(s: Schedule) -> None:
    expected = brute_force_steps(s, 2000)
    assert [k for k in range(900) if s.is_checkpoint(k)] == [k for k in expected if k < 900]
    for step in range(-1, 800, 7):
        assert s.next_after(step) == min(k for k in expected if k > step)


def test_a_zero_or_negative_interval_or_an_unknown_mode_is_refused_when_parsed() -> None:
    with pytest.raises(ValidationError):
        Schedule.model_validate({"anchor": 10, "interval": 0})
    with pytest.raises(ValidationError):
        Schedule.model_validate({"anchor": -1, "interval": 10})
    with pytest.raises(ValidationError):
        Schedule.model_validate({"anchor": 0, "interval": 10, "mode": "sometimes"})
