"""The coordinator's rules on plain objects: no database, no HTTP, no clock.

Each rule is ``decide(job, input, now) -> (reply, changes)``; these tests check the reply,
the state it leaves, and the Changes the repository would write.
"""

from __future__ import annotations

import math

import pytest
from checkflow_server.domain import checkpoints, jobs, ranks, tuning
from checkflow_server.domain.changes import EventKind
from checkflow_server.domain.errors import Conflict, NotFound, StaleGeneration
from checkflow_server.domain.state import Job

from checkflow.interval import Profile, choose_interval
from checkflow.protocol import (
    Action,
    CheckpointSource,
    CheckpointStatus,
    CommitReport,
    FinishRequest,
    Heartbeat,
    IntervalMode,
    JobCreate,
    NodeHeartbeat,
    PartReport,
    RankHeartbeat,
    RankState,
    RecoverRequest,
    RegisterRequest,
    Schedule,
)


def started_job(world: int = 2, *, timeout: float = 10.0, now: float = 100.0) -> Job:
    """A job of ``world`` ranks, all registered in generation 1 at ``now``."""
    body = JobCreate(name="j", world_size=world, heartbeat_timeout_s=timeout)
    job, _ = jobs.create_job(body, now, warmup_interval=10)
    for r in range(world):
        ranks.register(job, r, RegisterRequest(instance=f"p{r}"), now)
    return job


def beat(job: Job, rank: int, step: int, now: float = 101.0, **measured: float) -> Action:
    hb = Heartbeat(generation=job.generation, step=step, **measured)
    reply, _ = ranks.rank_heartbeat(job, rank, hb, now)
    return reply.action


def persist(job: Job, step: int, rank: int, now: float = 102.0) -> bool:
    body = PartReport(generation=job.generation, nbytes=10, duration_s=0.1, manifest_path="m")
    reply, _ = checkpoints.report_part(job, step, rank, body, now)
    return reply.must_commit


def committed(job: Job, step: int) -> None:
    movers = [r for r in range(job.world_size) if persist(job, step, r)]
    assert len(movers) == 1
    checkpoints.commit(job, step, CommitReport(rank=movers[0]), 103.0)


def test_a_new_job_is_written_once_with_its_creation_event() -> None:
    job, changes = jobs.create_job(JobCreate(name="j", world_size=4), 5.0, warmup_interval=7)
    warmup = Schedule(anchor=0, interval=7, mode=IntervalMode.WARMUP)
    assert (job.generation, job.schedule, job.registered) == (1, warmup, 0)
    assert changes.created and not changes.ranks  # rank rows come with registrations
    assert [(e.kind, e.detail) for e in changes.events] == [
        (EventKind.JOB_CREATED, {"world_size": 4})
    ]


def test_registration_replies_with_the_schedule_and_writes_the_rank() -> None:
    job, _ = jobs.create_job(JobCreate(name="j", world_size=2), 0.0, warmup_interval=10)
    reply, changes = ranks.register(job, 1, RegisterRequest(instance="a", node="h"), 1.0)
    assert (reply.generation, reply.restore_step, reply.next_checkpoint_step) == (1, None, 10)
    assert list(changes.ranks) == [1] and job.ranks.node[1] == "h" and job.ranks.watch[1] == 1.0
    again, changes = ranks.register(job, 1, RegisterRequest(instance="a"), 2.0)
    assert again == reply and not changes.writes()  # a retry, not a crash


def test_a_crashed_rank_registering_again_starts_a_generation_and_others_abort() -> None:
    job = started_job(2)
    committed(job, 10)
    persist(job, 20, 0)
    reply, changes = ranks.register(job, 1, RegisterRequest(instance="new"), 110.0)
    assert (reply.generation, reply.restore_step, reply.next_checkpoint_step) == (2, 10, 20)
    assert [e.kind for e in changes.events] == [
        EventKind.RANK_FAILED,
        EventKind.GENERATION_STARTED,
    ]
    assert job.checkpoints[20].status == CheckpointStatus.ABANDONED
    assert list(changes.checkpoints) == [20] and changes.job
    stale, step_before = Heartbeat(generation=1, step=21), job.ranks.step[0]
    with pytest.raises(StaleGeneration, match="moved to generation 2") as refused:
        ranks.rank_heartbeat(job, 0, stale, 111.0)
    # Fenced: only that rank 0 heard its generation ended is recorded, not its step.
    changes = refused.value.changes
    assert job.ranks.state[0] == RankState.ABORTED and job.ranks.step[0] == step_before
    assert list(changes.ranks) == [0] and changes.heartbeats == [] and not changes.events


def test_recovery_ends_when_every_rank_registered_in_the_new_generation() -> None:
    job = started_job(2)
    ranks.register(job, 0, RegisterRequest(instance="restarted"), 200.0)
    assert job.recovering_since == 200.0
    _, changes = ranks.register(job, 1, RegisterRequest(), 203.5)
    assert job.recovering_since is None and changes.job
    assert [(e.kind, e.detail) for e in changes.events] == [
        (EventKind.RECOVERED, {"duration_s": 3.5})
    ]


def test_heartbeats_record_progress_and_the_node_reply_lists_each_rank() -> None:
    job = started_job(4)
    body = NodeHeartbeat(
        ranks=[
            RankHeartbeat(rank=2, generation=1, step=7, iteration_s=0.2),
            RankHeartbeat(rank=3, generation=1, step=9),
        ]
    )
    reply, changes = ranks.node_heartbeat(job, "host-b", body, 150.0)
    assert [(r.rank, r.action) for r in reply.ranks] == [(2, "continue"), (3, "continue")]
    assert (reply.generation, reply.next_checkpoint_step, job.max_step) == (1, 10, 9)
    assert changes.heartbeats == [2, 3] and changes.heartbeats_received == 2
    t = job.ranks
    assert (t.node[2], t.step[2], t.iteration_s[2], t.last_heartbeat[3]) == ("host-b", 7, 0.2, 150)


def test_a_refused_heartbeat_changes_nothing() -> None:
    job = started_job(2)
    before = (list(job.ranks.step), list(job.ranks.watch), job.max_step)
    bad_rank = NodeHeartbeat(
        ranks=[
            RankHeartbeat(rank=0, generation=1, step=5),
            RankHeartbeat(rank=9, generation=1, step=5),
        ]
    )
    with pytest.raises(NotFound, match="rank 9"):
        ranks.node_heartbeat(job, "h", bad_rank, 150.0)
    with pytest.raises(Conflict, match="generation 3 is newer"):
        ranks.rank_heartbeat(job, 0, Heartbeat(generation=3, step=5), 150.0)
    assert (list(job.ranks.step), list(job.ranks.watch), job.max_step) == before


def test_exactly_one_rank_commits_and_a_retry_gets_the_same_answer() -> None:
    job = started_job(3)
    assert [persist(job, 10, r) for r in range(3)] == [False, False, True]
    assert persist(job, 10, 2) is True
    with pytest.raises(NotFound):
        checkpoints.commit(job, 30, CommitReport(), 104.0)
    persist(job, 20, 0)
    with pytest.raises(Conflict, match="only 1 of 3 ranks persisted"):
        checkpoints.commit(job, 20, CommitReport(rank=0), 104.0)
    reply, changes = checkpoints.commit(job, 10, CommitReport(rank=2), 104.0)
    assert (reply.status, reply.committer, changes.committed) == ("committed", 2, 1)
    assert job.restore_step() == 10
    _, changes = checkpoints.commit(job, 10, CommitReport(rank=2), 105.0)
    assert changes.committed == 0 and not changes.writes()


def test_a_step_abandoned_by_an_older_generation_is_taken_again_from_scratch() -> None:
    job = started_job(2)
    persist(job, 10, 0)
    jobs.recover(job, RecoverRequest(), 110.0)  # generation 2; step 10 abandoned
    for r in range(2):
        ranks.register(job, r, RegisterRequest(), 111.0)
    body = PartReport(generation=2, nbytes=5, duration_s=0.1, manifest_path="m")
    reply, changes = checkpoints.report_part(job, 10, 1, body, 112.0)
    assert (reply.status, reply.persisted_ranks, job.checkpoints[10].nbytes) == (
        "in_progress",
        1,
        5,
    )
    assert changes.parts_cleared == [10] and [s for s, _ in changes.parts] == [10]
    stale = PartReport(generation=1, nbytes=5, duration_s=0.1, manifest_path="m")
    with pytest.raises(Conflict, match="generation 1 is not"):
        checkpoints.report_part(job, 10, 0, stale, 112.0)


def test_silent_ranks_fail_the_generation_and_abandon_what_was_in_flight() -> None:
    job = started_job(3, timeout=5.0, now=100.0)
    beat(job, 0, 3, now=104.0)
    persist(job, 10, 0)
    assert not ranks.detect(job, 104.9).writes()
    changes = ranks.detect(job, 105.5)
    assert [(e.kind, e.rank) for e in changes.events] == [
        (EventKind.RANK_FAILED, 1),
        (EventKind.RANK_FAILED, 2),
        (EventKind.GENERATION_STARTED, None),
    ]
    assert changes.events[0].detail["silent_s"] == pytest.approx(5.5)
    assert changes.events[0].generation == 1 and changes.events[2].generation == 2
    assert (job.generation, job.failures, job.checkpoints[10].status) == (2, 1, "abandoned")
    assert job.ranks.watch[1] == math.inf and list(changes.ranks) == [1, 2]


def test_finish_stops_watching_and_a_stale_generation_conflicts() -> None:
    job = started_job(2)
    reply, changes = ranks.finish(job, 1, FinishRequest(generation=1, step=40), 120.0)
    assert (reply.state, reply.step, reply.seconds_since_heartbeat) == ("finished", 40, 20.0)
    assert job.ranks.watch[1] == math.inf and job.max_step == 40 and list(changes.ranks) == [1]
    with pytest.raises(Conflict):
        ranks.finish(job, 0, FinishRequest(generation=2), 120.0)


def test_the_interval_waits_for_every_rank_then_follows_the_slowest() -> None:
    job = started_job(2)
    beat(job, 0, 1, iteration_s=0.05, stall_s=0.01, persist_s=0.2)
    assert not tuning.retune(job, 130.0).writes()  # rank 1 may be the slow one
    beat(job, 1, 1, iteration_s=0.1, stall_s=0.07, persist_s=0.5)
    changes = tuning.retune(job, 130.0)
    expected = choose_interval(Profile(iteration_s=0.1, cost_s=0.07, persist_s=0.5))
    # The change counts from the newest checkpoint (none yet: step 0) at once; the ranks
    # adopt it at their next due step (10) at the latest, never from a step far ahead.
    assert job.schedule == Schedule(anchor=0, interval=expected, mode=IntervalMode.TUNED)
    assert changes.job and changes.events[0].detail["from_step"] == 10
    beat(job, 1, 2, iteration_s=1.0, stall_s=0.5)
    again = tuning.retune(job, 131.0)  # a new measurement is taken at once too
    slower = choose_interval(Profile(iteration_s=1.0, cost_s=0.5, persist_s=0.5))
    assert again.job and job.schedule.interval == slower != expected


def test_a_warm_up_interval_that_measures_right_still_becomes_tuned() -> None:
    job = started_job(1)
    profile = Profile(iteration_s=0.1, cost_s=0.035, persist_s=0.1)  # k = 10 exactly
    assert choose_interval(profile) == 10
    beat(job, 0, 1, iteration_s=0.1, stall_s=0.035, persist_s=0.1)
    assert tuning.retune(job, 130.0).job
    assert (job.schedule.interval, job.schedule.mode) == (10, IntervalMode.TUNED)
    assert not tuning.retune(job, 131.0).writes()  # nothing new


def test_a_fixed_every_is_shown_as_fixed_and_never_retuned() -> None:
    job, _ = jobs.create_job(JobCreate(name="j", world_size=1, every=20), 100.0, 10)
    assert job.schedule == Schedule(anchor=0, interval=20, mode=IntervalMode.FIXED)
    ranks.register(job, 0, RegisterRequest(instance="p0"), 100.0)
    beat(job, 0, 1, iteration_s=0.003, stall_s=0.05, persist_s=0.2)
    assert not tuning.retune(job, 130.0).writes()
    persist(job, 60, 0)  # counted from: a fixed every keeps its multiples
    assert (job.schedule.interval, job.schedule.anchor, job.next_checkpoint_step()) == (20, 0, 80)
    # The ranks restarted with every="auto": the job shows what they apply now.
    assert jobs.reopen_job(job, JobCreate(name="j", world_size=1), 140.0, 10).job
    assert job.schedule == Schedule(anchor=60, interval=10, mode=IntervalMode.WARMUP)


def test_auto_counts_from_the_newest_checkpoint_and_next_is_never_below_restore() -> None:
    # Issue 32: "next checkpoint" 980 was shown below "restore step" 1060: heartbeats (the
    # step) come once a second, a checkpoint's reports as soon as it is persisted.
    job = started_job(1)
    job.schedule = Schedule(anchor=0, interval=20, mode=IntervalMode.TUNED)
    beat(job, 0, 970)
    committed(job, 1060)
    assert job.restore_step() == 1060 and job.max_step == 1060
    assert (job.schedule.anchor, job.next_checkpoint_step()) == (1060, 1080)


def test_recover_abandons_newer_commits_and_refuses_an_uncommitted_step() -> None:
    job = started_job(2)
    committed(job, 10)
    committed(job, 20)
    persist(job, 30, 0)
    with pytest.raises(Conflict, match="checkpoint 30 of job 'j' is in_progress"):
        jobs.recover(job, RecoverRequest(step=30), 140.0)
    reply, changes = jobs.recover(job, RecoverRequest(step=10), 140.0)
    assert (reply.generation, reply.step) == (2, 10)
    statuses = {s: c.status for s, c in job.checkpoints.items()}
    assert statuses == {10: "committed", 20: "abandoned", 30: "abandoned"}
    assert sorted(changes.checkpoints) == [20, 30]
    assert job.schedule == Schedule(anchor=10, interval=10, mode=IntervalMode.WARMUP)
    assert job.max_step == 10 and job.next_checkpoint_step() == 20


def test_a_new_world_size_resizes_the_job_in_a_new_generation() -> None:
    job = started_job(2)
    assert not jobs.reopen_job(job, JobCreate(name="j", world_size=2), 150.0, 10).writes()
    changes = jobs.reopen_job(job, JobCreate(name="j", world_size=3), 150.0, 10)
    assert changes.ranks_cleared and len(job.ranks) == 3 and job.generation == 2
    assert changes.events[0].detail == {"old_world_size": 2, "world_size": 3}


def test_commits_found_on_storage_count_once() -> None:
    job = started_job(2)
    persist(job, 20, 0)
    changes = checkpoints.learn_commits(job, [10, 20], 160.0)
    assert changes.committed == 2 and job.restore_step() == 20
    assert job.checkpoints[10].source == CheckpointSource.STORAGE
    assert checkpoints.learn_commits(job, [10, 20], 161.0).committed == 0
