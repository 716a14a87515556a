"""Save-decision policies and the cost meter: pure objects, tested without threads or storage."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from checkflow.policy import FrequencyTuner
from checkflow.write.measure import CostMeter
from checkflow.write.policy import AutoInterval, CoordinatorSchedule, FixedInterval, save_policy


def _due_steps(policy, steps, last=0):
    """Steps 1..steps at which ``policy`` is due, recording each as the newest checkpoint."""
    out = []
    for step in range(1, steps + 1):
        if policy.is_due(step, last):
            out.append(step)
            last = step
    return out


def test_fixed_interval_is_due_on_multiples_of_every():
    assert _due_steps(FixedInterval(3), 10) == [3, 6, 9]


def test_fixed_interval_after_a_restore_keeps_the_multiples_not_the_distance():
    # Restored at step 7 with every=5: the next checkpoint is step 10, as on every rank.
    policy = FixedInterval(5)
    assert [s for s in range(8, 16) if policy.is_due(s, 7)] == [10, 15]


@pytest.mark.parametrize("every", [0, -2, True, 1.5, "3"])
def test_fixed_interval_refuses_what_is_not_a_positive_int(every):
    with pytest.raises(ValueError, match="every must be a positive int"):
        FixedInterval(every)


def test_auto_interval_uses_the_tuners_warm_up_interval_since_the_last_checkpoint():
    policy = AutoInterval(FrequencyTuner(warmup_interval=4))
    assert policy.interval == 4
    assert _due_steps(policy, 10) == [4, 8]
    # Counted from the last checkpoint (a save() at step 6 moves the next one to 10).
    assert not policy.is_due(9, 6) and policy.is_due(10, 6)


def test_auto_interval_follows_the_tuner_when_it_changes():
    tuner = FrequencyTuner(warmup_interval=10)
    policy = AutoInterval(tuner)
    tuner.interval = 2
    assert _due_steps(policy, 6) == [2, 4, 6]


def test_auto_interval_applies_the_agreed_interval_of_rank_0_over_its_own():
    agreed: list[int | None] = [None]
    policy = AutoInterval(FrequencyTuner(warmup_interval=10), agreed_interval=lambda: agreed[0])
    assert policy.interval == 10  # no agreement yet: the local (warm-up) interval
    agreed[0] = 3
    assert policy.interval == 3
    assert _due_steps(policy, 9) == [3, 6, 9]


def test_coordinator_schedule_answers_with_the_coordinators_decision():
    schedule = {5: True, 10: True}
    policy = CoordinatorSchedule(lambda s: schedule.get(s, False), fallback=FixedInterval(2))
    assert _due_steps(policy, 10) == [5, 10]  # the fallback's 2, 4, ... are not used


def test_coordinator_schedule_falls_back_while_the_coordinator_has_not_answered():
    answers: dict[int, bool | None] = {}
    policy = CoordinatorSchedule(lambda s: answers.get(s), fallback=FixedInterval(3))
    assert _due_steps(policy, 6) == [3, 6]
    answers.update({7: True, 8: False, 9: False})
    assert [s for s in (7, 8, 9) if policy.is_due(s, 6)] == [7]


def _done(step: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(step)
    return f


def test_cost_meter_feeds_the_tuner_stall_plus_slow_down_once_the_persist_is_known():
    tuner = FrequencyTuner(warmup_interval=10)
    meter = CostMeter(tuner)
    for _ in range(3):
        assert not meter.step_ended(0.1)  # baseline steps, no checkpoint in flight
    assert tuner.iteration_s == pytest.approx(0.1)
    meter.checkpoint_started(10, stall_s=0.05, future=Future())
    meter.optimizer_waited(10, 0.01)
    assert not meter.step_ended(0.3)  # slowed by 0.2 s while the persist runs
    meter.persisted(10, duration_s=0.5, last_stall_s=0.06)
    assert meter.step_ended(0.15)  # another 0.05 s of slow-down completes the measurement
    assert meter.last_cost_s == pytest.approx(0.05 + 0.01 + 0.2 + 0.05)
    assert meter.last_persist_s == 0.5
    profile = tuner.profile
    assert profile is not None
    assert profile.cost_s == pytest.approx(0.31) and profile.persist_s == 0.5


def test_cost_meter_keeps_measuring_the_first_checkpoint_while_a_second_is_taken():
    tuner = FrequencyTuner(warmup_interval=10)
    meter = CostMeter(tuner)
    meter.step_ended(0.1)
    meter.checkpoint_started(10, stall_s=0.05, future=Future())
    meter.checkpoint_started(20, stall_s=0.07, future=Future())  # still persisting 10
    meter.persisted(20, duration_s=0.4, last_stall_s=0.07)
    assert not meter.step_ended(0.1)  # 20 is not the one measured
    meter.persisted(10, duration_s=0.9, last_stall_s=0.07)
    assert meter.step_ended(0.1)
    assert tuner.profile is not None and tuner.profile.persist_s == 0.9


def test_cost_meter_replaces_a_measurement_whose_persist_failed():
    meter = CostMeter(FrequencyTuner(warmup_interval=10))
    meter.checkpoint_started(10, stall_s=0.05, future=_done(10))  # done, never persisted
    meter.checkpoint_started(20, stall_s=0.02, future=Future())
    meter.persisted(20, duration_s=0.3, last_stall_s=0.02)
    assert meter.step_ended(0.1)
    assert meter.last_persist_s == 0.3


def test_retune_logs_the_change_with_its_step_and_the_checkpoints_measured(caplog):
    import logging

    tuner = FrequencyTuner(warmup_interval=10, max_overhead=0.05)
    meter = CostMeter(tuner)
    meter.step_ended(0.1)
    meter.checkpoint_started(10, stall_s=0.2, future=Future())
    meter.persisted(10, duration_s=0.3, last_stall_s=0.2)
    assert meter.step_ended(0.1)
    log = logging.getLogger("checkflow.test-retune")
    with caplog.at_level(logging.INFO, logger=log.name):
        # cost 0.2 s at 5 % of 0.1 s steps: 40 steps
        assert meter.retune(log, 11) == 40
        assert meter.retune(log, 12) == 40  # unchanged: not logged again
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("checkpoint interval now 40 steps (was 10; at step 11 after 1")


def test_cost_meter_without_a_tuner_only_keeps_the_last_stall_and_persist():
    meter = CostMeter(None)
    meter.checkpoint_started(5, stall_s=0.04, future=Future())
    meter.persisted(5, duration_s=0.2, last_stall_s=0.04)
    assert not meter.step_ended(0.1)
    assert (meter.last_cost_s, meter.last_persist_s) == (0.04, 0.2)


def test_save_policy_for_a_fixed_every_ignores_the_coordinator():
    policy = save_policy(4, None, ask=lambda s: True)
    assert policy == FixedInterval(4)


def test_save_policy_for_auto_asks_the_coordinator_first_then_the_agreed_interval():
    tuner = FrequencyTuner(warmup_interval=10)
    answers: dict[int, bool | None] = {3: True}
    policy = save_policy("auto", tuner, agreed_interval=lambda: 5, ask=answers.get)
    assert isinstance(policy, CoordinatorSchedule)
    assert _due_steps(policy, 10) == [3, 8]  # the coordinator's 3, then 5 steps later
    local = save_policy("auto", tuner, agreed_interval=lambda: None)
    assert isinstance(local, AutoInterval) and local.interval == 10


def test_save_policy_for_auto_without_a_tuner_is_refused():
    with pytest.raises(ValueError, match="needs a FrequencyTuner"):
        save_policy("auto", None)
