"""Save-decision policies and the cost meter: pure objects, tested without threads or storage."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from checkflow.interval import FrequencyTuner
from checkflow.write.decisions import (
    AutoInterval,
    FixedInterval,
    adopted_interval,
    proposed_interval,
    save_policy,
)
from checkflow.write.measure import CostMeter


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


class Agreed:
    """A ``RankSync`` as the policy sees it: rank 0's proposal at the last agreement."""

    def __init__(self, interval: int | None = None) -> None:
        self.interval = interval


class Coordinator:
    """A ``CoordinatorClient`` as the policy sees it: its tuned interval, or None."""

    def __init__(self, tuned: int | None = None) -> None:
        self.tuned_interval = tuned


def test_auto_interval_applies_the_agreed_interval_of_rank_0_over_its_own():
    agreed = Agreed()
    policy = AutoInterval(FrequencyTuner(warmup_interval=10), agreement=agreed)
    assert policy.interval == 10  # no agreement yet: the local (warm-up) interval
    agreed.interval = 3
    assert policy.interval == 3
    assert _due_steps(policy, 9) == [3, 6, 9]


def test_a_tuned_coordinator_interval_wins_over_the_local_tuner_and_a_warm_up_does_not():
    assert proposed_interval(tuned=None, local=37) == 37  # coordinator still measuring
    assert proposed_interval(tuned=112, local=37) == 112


def test_one_process_adopts_its_proposal_at_once_and_ranks_adopt_the_agreed_one():
    assert adopted_interval(proposed=112, local=10, agreed=None, shared=False) == 112
    # Ranks before the first agreement: the warm-up interval, the same on every rank.
    assert adopted_interval(proposed=112, local=10, agreed=None, shared=True) == 10
    assert adopted_interval(proposed=112, local=10, agreed=50, shared=True) == 50


def test_a_new_coordinator_interval_applies_from_the_next_due_step_at_the_latest():
    # Issue 32: 3 ms steps checkpointed every 10 steps for the whole run, because the
    # coordinator's 112 was to start at step 3120. Counted from the last checkpoint, the
    # new interval decides the very next step.
    coordinator = Coordinator()
    policy = AutoInterval(FrequencyTuner(warmup_interval=10), coordinator=coordinator)
    due, last = [], 0
    for step in range(1, 400):
        if step == 25:
            coordinator.tuned_interval = 112  # heard between the checkpoints 20 and 30
        if policy.is_due(step, last):
            due.append(step)
            last = step
    assert due == [10, 20, 132, 244, 356]
    assert policy.interval == 112


def test_ranks_adopt_rank_0s_coordinator_interval_at_the_next_checkpoint():
    # Rank 0 heard the coordinator's 112, rank 1 not yet: both apply the 10 agreed at the
    # last checkpoint until the next, where rank 0's proposal (112) is agreed.
    agreed = Agreed(10)
    rank0 = AutoInterval(FrequencyTuner(), agreement=agreed, coordinator=Coordinator(112))
    rank1 = AutoInterval(FrequencyTuner(), agreement=agreed, coordinator=Coordinator(None))
    assert (rank0.proposed, rank1.proposed) == (112, 10)
    due: list[list[int]] = [[], []]
    last = 20
    for step in range(21, 300):
        answers = [rank0.is_due(step, last), rank1.is_due(step, last)]
        assert answers[0] == answers[1]  # the same steps on every rank
        if answers[0]:
            due[0].append(step)
            last = step
            agreed.interval = rank0.proposed  # the agreement at that checkpoint
    assert due[0] == [30, 142, 254]


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
    policy = save_policy(4, None, Agreed(9), Coordinator(7))
    assert policy == FixedInterval(4) and policy.interval == 4 and policy.proposed is None


def test_save_policy_for_auto_applies_the_coordinators_tuned_interval():
    tuner = FrequencyTuner(warmup_interval=10)
    policy = save_policy("auto", tuner, None, Coordinator(3))
    assert isinstance(policy, AutoInterval)
    assert _due_steps(policy, 10) == [3, 6, 9]
    local = save_policy("auto", tuner)
    assert isinstance(local, AutoInterval) and local.interval == 10


def test_save_policy_for_auto_without_a_tuner_is_refused():
    with pytest.raises(ValueError, match="needs a FrequencyTuner"):
        save_policy("auto", None)
