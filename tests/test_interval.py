"""CheckFreq interval choice, Young/Daly bound, and the online tuner."""

from __future__ import annotations

import pytest

from checkflow.interval import PERSIST_HEADROOM, FrequencyTuner, Profile, choose_interval


def test_interval_is_the_smallest_that_keeps_overhead_under_budget():
    # A 0.1 s checkpoint on 1 s steps: 0.1 / (k * 1) <= 0.035 -> k = 3 (2.86 rounds up).
    p = Profile(iteration_s=1.0, cost_s=0.1, persist_s=0.5)
    assert choose_interval(p, max_overhead=0.035) == 3
    assert 0.1 / (3 * 1.0) <= 0.035 < 0.1 / (2 * 1.0)


def test_interval_lets_each_persist_finish_with_headroom_before_the_next_is_due():
    # 2.05 s of persist on 0.1 s steps needs 21 steps; with 25 % headroom 25.6 -> 26, so a
    # persist somewhat slower than its median still ends before a third snapshot is due.
    p = Profile(iteration_s=0.1, cost_s=0.001, persist_s=2.05)
    assert PERSIST_HEADROOM == 1.25
    assert choose_interval(p, max_overhead=0.5) == 26


def test_young_daly_bounds_the_interval_when_failures_are_frequent():
    p = Profile(iteration_s=1.0, cost_s=10.0, persist_s=0.0)
    assert choose_interval(p, max_overhead=0.01) == 1000
    # sqrt(2 * 10 * 500) = 100 steps: failures every 500 s make lost work the bigger cost.
    assert choose_interval(p, max_overhead=0.01, mtbf_s=500) == 100


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="max_overhead"):
        choose_interval(Profile(iteration_s=1, cost_s=1, persist_s=1), max_overhead=0)


def test_tuner_starts_at_warmup_then_adapts_to_slower_steps():
    t = FrequencyTuner(max_overhead=0.05, warmup_interval=10, window=5)
    assert t.interval == 10 and not t.update()
    for _ in range(5):
        t.observe_iteration(0.1)
    t.observe_checkpoint(cost_s=0.05, persist_s=0.2)
    t.update()
    assert t.interval == 10  # 0.05 / (k * 0.1) <= 0.05 -> k = 10
    t.interval = 3
    assert t.update() and t.interval == 10
    for _ in range(5):
        t.observe_iteration(1.0)  # steps got 10x slower: checkpoints are relatively cheaper
    assert t.update() and t.interval == 1
