"""Hang detection from progress, crash reports and the recovery events, on plain objects
with a fake clock (the ``now`` arguments): no database, no HTTP, no sleeping."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from checkflow_server.domain import checkpoints, jobs, progress, ranks
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.errors import Conflict, NotFound
from checkflow_server.domain.state import Job
from checkflow_server.repository import Repository

from checkflow.protocol import (
    CommitReport,
    FailureReport,
    Heartbeat,
    JobCreate,
    PartReport,
    RegisterRequest,
)


def job_of(world: int = 2, *, hang: float | None = 5.0, now: float = 100.0) -> Job:
    """``world`` ranks registered at ``now``; the heartbeat timeout (60 s) stays out of the
    way of the hang timeouts tested here."""
    body = JobCreate(name="j", world_size=world, heartbeat_timeout_s=60, hang_timeout_s=hang)
    job, _ = jobs.create_job(body, now, warmup_interval=10)
    for r in range(world):
        ranks.register(job, r, RegisterRequest(instance=f"p{r}"), now)
    return job


def beat(job: Job, rank: int, step: int, now: float, **fields: object) -> Changes:
    hb = Heartbeat(generation=job.generation, step=step, **fields)  # type: ignore[arg-type]
    return ranks.rank_heartbeat(job, rank, hb, now)[1]


def failed(changes: Changes) -> list[tuple[int | None, str, float]]:
    return [
        (e.rank, e.detail["kind"], e.detail["detection_s"])
        for e in changes.events
        if e.kind == EventKind.RANK_FAILED
    ]


def test_a_rank_whose_step_stands_still_while_it_heartbeats_is_hung() -> None:
    job = job_of(2, hang=5.0)
    beat(job, 0, 3, now=101.0)
    beat(job, 1, 3, now=101.0)
    for t in (102.0, 103.0, 104.0, 105.0, 106.0):
        beat(job, 0, int(t) - 98, now=t)  # rank 0 trains on
        beat(job, 1, 3, now=t)  # rank 1 beats, its step stands at 3
    assert not ranks.detect(job, 106.0).writes()  # 5.0 s still: not yet
    changes = ranks.detect(job, 106.5)
    assert failed(changes) == [(1, "hung", 5.5)]
    started = [e for e in changes.events if e.kind == EventKind.GENERATION_STARTED]
    assert started[0].detail["kind"] == "hung" and started[0].detail["detection_s"] == 5.5
    assert "while heartbeats went on" in started[0].detail["reason"]
    assert job.generation == 2 and job.ranks.state[1] == "failed"


def test_every_rank_still_is_a_whole_job_stalled_in_a_collective() -> None:
    job = job_of(2, hang=5.0)
    beat(job, 0, 7, now=102.0)
    beat(job, 1, 6, now=101.0)
    for t in (103.0, 104.0, 105.0, 106.0, 107.0):
        beat(job, 0, 7, now=t)
        beat(job, 1, 6, now=t)
    changes = ranks.detect(job, 107.5)
    assert failed(changes) == [(0, "hung", 5.5), (1, "hung", 6.5)]
    started = [e for e in changes.events if e.kind == EventKind.GENERATION_STARTED][0]
    assert "whole job is stalled" in started.detail["reason"]
    # The job's latency: the last evidence of progress, the smaller of the two.
    assert started.detail["detection_s"] == 5.5


def test_a_paused_heartbeat_restarts_every_ranks_progress_clock() -> None:
    job = job_of(2, hang=5.0)
    beat(job, 0, 3, now=101.0)
    beat(job, 1, 3, now=101.0)
    # Rank 0 evaluates for 20 s (paused); rank 1 waits for it in a collective, not paused.
    for t in range(102, 122):
        beat(job, 0, 3, now=float(t), paused=True)
        beat(job, 1, 3, now=float(t))
        assert not ranks.detect(job, t + 0.5).writes()
    # The pause ended at 121: the clocks run from there.
    beat(job, 0, 3, now=122.0)
    assert not ranks.detect(job, 126.0).writes()
    assert failed(ranks.detect(job, 126.5)) == [(0, "hung", 5.5), (1, "hung", 5.5)]


def test_a_rank_that_never_advanced_past_its_restore_step_gets_the_warmup_grace() -> None:
    job = job_of(2, hang=5.0)
    beat(job, 0, 1, now=101.0)  # rank 0 trained a step; rank 1 is still compiling
    beat(job, 0, 1, now=150.0)
    beat(job, 1, 0, now=150.0)
    limit = 100.0 + progress.WARMUP_GRACE_S
    changes = ranks.detect(job, 150.0)
    assert failed(changes) == [(0, "hung", 49.0)]
    job = job_of(1, hang=5.0)
    beat(job, 0, 0, now=limit - 1)
    assert not ranks.detect(job, limit - 0.5).writes()
    assert failed(ranks.detect(job, limit + 0.5)) == [(0, "hung", progress.WARMUP_GRACE_S + 0.5)]


def test_the_default_hang_timeout_is_ten_median_step_times_with_a_floor() -> None:
    job = job_of(3, hang=None)
    assert progress.hang_timeout(job, None) == progress.HANG_FLOOR_S  # nothing measured yet
    for r, step_s in enumerate((2.0, 9.0, 30.0)):
        beat(job, r, 1, now=101.0, iteration_s=step_s)
    assert progress.hang_timeout(job, None) == 10 * 9.0
    assert progress.hang_timeout(job, 7.0) == 7.0  # the coordinator's --hang-timeout
    job.hang_timeout_s = 3.0
    assert progress.hang_timeout(job, 7.0) == 3.0  # the job's own setting wins
    job = job_of(1, hang=None)
    beat(job, 0, 1, now=101.0, iteration_s=0.1)
    assert progress.hang_timeout(job, None) == progress.HANG_FLOOR_S
    beat(job, 0, 1, now=100.0 + progress.HANG_FLOOR_S)  # alive, but still at step 1
    assert not ranks.detect(job, 101.0 + progress.HANG_FLOOR_S).writes()
    assert failed(ranks.detect(job, 101.5 + progress.HANG_FLOOR_S))[0][1] == "hung"


def test_a_coordinator_restart_restarts_progress_clocks() -> None:
    job = job_of(2, hang=5.0)
    beat(job, 0, 4, now=101.0)
    beat(job, 1, 4, now=101.0)
    ranks.restarted(job, 130.0)  # down for 29 s: the ranks could not report
    assert job.ranks.progress_at == [130.0, 130.0]
    assert not ranks.detect(job, 134.0).writes()
    # Warm-up grace again until a rank advances (its registration step is not stored).
    beat(job, 0, 5, now=131.0)
    beat(job, 1, 4, now=131.0)
    assert failed(ranks.detect(job, 136.5)) == [(0, "hung", 5.5)]


def test_a_crash_report_fails_the_rank_now_once_and_only_in_its_generation() -> None:
    job = job_of(2)
    report = FailureReport(generation=1, exit_code=1, detail="OOM", seconds_ago=0.25)
    reply, changes = ranks.report_failure(job, 1, report, 102.0)
    assert reply.state == "failed" and job.generation == 2
    assert failed(changes) == [(1, "crash", 0.25)]
    assert "exit code 1: OOM" in changes.events[0].detail["reason"]
    again, changes = ranks.report_failure(job, 1, report, 103.0)  # a retried report
    assert again.state == "failed" and not changes.writes() and job.generation == 2
    # Rank 0 was alive in generation 1: a late report of its crash there changes its state
    # but starts no third generation.
    _, changes = ranks.report_failure(job, 0, report, 104.0)
    assert failed(changes) == [(0, "crash", 0.25)] and job.generation == 2
    with pytest.raises(Conflict, match="newer"):
        ranks.report_failure(job, 0, FailureReport(generation=3), 105.0)
    with pytest.raises(NotFound):
        ranks.report_failure(job, 2, report, 105.0)


def test_the_job_trains_again_when_a_rank_passes_its_restore_step() -> None:
    job = job_of(2)
    for r in range(2):
        body = PartReport(generation=1, nbytes=1, duration_s=0.1, manifest_path="m")
        checkpoints.report_part(job, 10, r, body, 101.0)
    checkpoints.commit(job, 10, CommitReport(rank=1), 101.0)
    beat(job, 1, 12, now=102.0)
    ranks.report_failure(job, 1, FailureReport(generation=2 - 1, seconds_ago=0.5), 103.0)
    for r in range(2):
        reply, _ = ranks.register(job, r, RegisterRequest(instance=f"q{r}"), 105.0)
        assert reply.restore_step == 10
    assert not beat(job, 0, 10, now=106.0).events  # restored, not trained yet
    changes = beat(job, 0, 11, now=107.0)
    [event] = changes.events
    assert (event.kind, event.rank, event.generation) == (EventKind.TRAINED_AGAIN, 0, 2)
    assert event.detail == {
        "fault_kind": "crash",
        "failed_ranks": "1",
        "detection_s": 0.5,
        "restore_step": 10,
        "step": 11,
        "recovery_s": 4.0,
        "fault_to_training_s": 4.5,
    }
    assert job.recovery is None and not beat(job, 1, 11, now=107.0).events  # once


def test_a_pending_recovery_survives_a_coordinator_restart(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "c.db")
    body = JobCreate(name="j", world_size=1, hang_timeout_s=2.5)
    job, changes = jobs.create_job(body, 100.0, warmup_interval=10)
    repo.save(job, changes)
    repo.save(job, ranks.register(job, 0, RegisterRequest(instance="a"), 100.0)[1])
    repo.save(job, ranks.detect(job, 200.0))  # silent
    repo.close()
    repo = Repository(tmp_path / "c.db")
    [loaded] = repo.load_jobs()
    assert loaded.hang_timeout_s == 2.5 and loaded.recovery is not None
    assert (loaded.recovery.kind, loaded.recovery.ranks, loaded.recovery.started) == (
        "silent",
        "0",
        200.0,
    )
    ranks.restarted(loaded, 210.0)
    repo.save(loaded, ranks.register(loaded, 0, RegisterRequest(instance="b"), 211.0)[1])
    repo.save(loaded, beat(loaded, 0, 1, now=215.0))
    repo.close()
    [again] = Repository(tmp_path / "c.db").load_jobs()
    assert again.recovery is None  # trained_again was written
    assert again.ranks.progress_at == [math.inf]  # in memory only: restarted() sets it


def test_a_database_of_an_older_coordinator_gets_the_new_column(tmp_path: Path) -> None:
    import sqlite3

    from tests.support.old_schema import PRE_ALEMBIC_SCHEMA

    # The first coordinator's jobs table: no hang_timeout_s nor interval_mode yet, and the
    # prev_interval/prev_anchor columns that are no longer written.
    old = """CREATE TABLE jobs (
        id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, storage_uri TEXT,
        world_size INTEGER NOT NULL, max_overhead REAL NOT NULL,
        heartbeat_timeout_s REAL NOT NULL, created REAL NOT NULL, generation INTEGER NOT NULL,
        generation_started REAL NOT NULL, recovering_since REAL, interval INTEGER NOT NULL,
        anchor INTEGER NOT NULL, prev_interval INTEGER, prev_anchor INTEGER,
        max_step INTEGER NOT NULL, failures INTEGER NOT NULL);"""
    conn = sqlite3.connect(tmp_path / "old.db")
    conn.executescript(old + PRE_ALEMBIC_SCHEMA)  # the other tables as they are
    conn.execute(
        "INSERT INTO jobs VALUES (1, 'j', NULL, 1, 0.035, 10, 0, 1, 0, NULL, 10, 10, NULL, NULL,"
        " 0, 0)"
    )
    conn.commit()
    conn.close()
    repo = Repository(tmp_path / "old.db")
    [job] = repo.load_jobs()
    assert (job.name, job.hang_timeout_s, job.recovery) == ("j", None, None)
    assert (job.schedule.interval, job.schedule.mode) == (10, "warmup")  # auto, as it was
    assert (job.state, job.rollback_step) == ("running", None)  # NULL in the old row
    job.hang_timeout_s = 7.0
    repo.save(job, Changes(job=True))  # the unused prev_* columns stay NULL
    repo.close()
    [again] = Repository(tmp_path / "old.db").load_jobs()
    assert again.hang_timeout_s == 7.0
