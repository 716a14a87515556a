"""The repository: what the rules changed is written, and loads back as it was."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from checkflow_server.domain import checkpoints, jobs, ranks, tuning
from checkflow_server.domain.changes import Changes
from checkflow_server.domain.state import Checkpoint, Job, Part, RankTable
from checkflow_server.repository import Repository, rows

from checkflow.protocol import (
    CheckpointKind,
    CheckpointStatus,
    CommitReport,
    Heartbeat,
    JobCreate,
    PartReport,
    RecoverRequest,
    RegisterRequest,
)


def play(repo: Repository) -> Job:
    """A job through registration, heartbeats, a commit, an in-flight checkpoint and a
    retune, every decision saved as the service saves it."""
    job, changes = jobs.create_job(
        JobCreate(name="j", world_size=2, storage_uri="s3://b/r"), 1.0, 10
    )
    repo.save(job, changes)

    def apply(result: tuple[object, Changes]) -> None:
        repo.save(job, result[1])

    for r in range(2):
        apply(ranks.register(job, r, RegisterRequest(instance=f"p{r}", node="n"), 2.0))
    for r in range(2):
        hb = Heartbeat(generation=1, step=12, iteration_s=0.1 * (r + 1), stall_s=0.05)
        apply(ranks.rank_heartbeat(job, r, hb, 3.0))
    for step, who in ((10, (0, 1)), (20, (1,))):
        for r in who:
            kind = CheckpointKind.DELTA if (step, r) == (10, 1) else None  # 20: not said
            part = PartReport(
                generation=1, nbytes=100 + r, duration_s=0.5, manifest_path=f"m{r}", kind=kind
            )
            apply(checkpoints.report_part(job, step, r, part, 4.0))
    apply(checkpoints.commit(job, 10, CommitReport(rank=1), 5.0))
    repo.save(job, tuning.retune(job, 6.0))
    return job


def ranks_of(t: RankTable) -> list[tuple[object, ...]]:
    return [
        (
            t.generation[r],
            t.state[r],
            t.instance[r],
            t.node[r],
            t.registered_at[r],
            t.last_heartbeat[r],
            t.step[r],
            t.iteration_s[r],
            t.stall_s[r],
            t.persist_s[r],
        )
        for r in range(len(t))
    ]


def test_a_saved_job_loads_back_as_it_was(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "c.db")
    job = play(repo)
    repo.close()
    (loaded,) = Repository(tmp_path / "c.db").load_jobs()
    assert loaded.id == job.id == 1
    assert rows.job_row(loaded) == rows.job_row(job)  # schedule, max_step, failures...
    assert loaded.schedule.mode == "tuned" and loaded.schedule.interval != 10
    assert ranks_of(loaded.ranks) == ranks_of(job.ranks)
    assert loaded.checkpoints[10].status == "committed" and loaded.checkpoints[10].parts == {}
    assert loaded.checkpoints[20].parts == job.checkpoints[20].parts  # in flight: parts kept
    assert [rows.checkpoint_row(1, c) for c in loaded.checkpoints.values()] == [
        rows.checkpoint_row(1, c) for c in job.checkpoints.values()
    ]
    assert (loaded.checkpoints[10].kind, loaded.checkpoints[20].kind) == ("delta", None)


def test_a_database_of_an_older_coordinator_gets_the_added_columns(tmp_path: Path) -> None:
    """``checkpoints.kind``, ``jobs.hang_timeout_s`` and ``jobs.interval_mode`` came after
    the first schema: a database without them opens, gains them (NULL in old rows) and
    stores them."""
    path = tmp_path / "old.db"
    old_schema = rows.SCHEMA.replace(", kind TEXT,", ",").replace(", hang_timeout_s REAL", "")
    old_schema = old_schema.replace(",\n    interval_mode TEXT", "")
    assert "interval_mode" not in old_schema and "hang_timeout_s" not in old_schema
    with sqlite3.connect(path) as conn:
        conn.executescript(old_schema)
    repo = Repository(path)
    job = play(repo)
    repo.close()
    (loaded,) = Repository(path).load_jobs()
    assert loaded.checkpoints[10].kind == "delta" and loaded.id == job.id
    assert loaded.schedule == job.schedule and loaded.schedule.mode == "tuned"


def test_a_job_row_of_an_older_coordinator_without_a_mode_loads_as_auto(tmp_path: Path) -> None:
    # An older coordinator retuned every job: its rows are every="auto" jobs.
    repo = Repository(tmp_path / "c.db")
    play(repo)
    repo.close()
    with sqlite3.connect(tmp_path / "c.db") as conn:
        conn.execute("UPDATE jobs SET interval_mode = NULL")
    (loaded,) = Repository(tmp_path / "c.db").load_jobs()
    assert loaded.schedule.mode == "warmup"


def test_events_are_the_newest_ones_oldest_first(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "c.db")
    job = play(repo)
    for t in (7.0, 8.0):
        repo.save(job, jobs.recover(job, RecoverRequest(), t)[1])
    kinds = [e.kind for e in repo.events(job, limit=100)]
    assert kinds == [
        "job_created",
        "interval_changed",
        "rollback_requested",
        "generation_started",
        "rollback_requested",
        "generation_started",
    ]
    last = repo.events(job, limit=2)
    assert [e.kind for e in last] == ["rollback_requested", "generation_started"]
    assert [e.id for e in repo.events(job, after=last[0].id)] == [last[1].id]
    assert last[1].detail == {"reason": "rollback requested", "restore_step": 10}


def test_every_column_of_the_schema_is_mapped_and_nothing_else(tmp_path: Path) -> None:
    # Adding a column means the schema and the *_row mapping, both in rows.py: this keeps
    # the two from drifting apart.
    conn = sqlite3.connect(":memory:")
    conn.executescript(rows.SCHEMA)

    def columns(table: str) -> list[str]:
        return [c[1] for c in conn.execute(f"PRAGMA table_info({table})")]

    job, _ = jobs.create_job(JobCreate(name="j", world_size=1), 1.0, 10)
    ck = Checkpoint(step=1, generation=1, status=CheckpointStatus.COMMITTED, started=1.0)
    _, changes = jobs.recover(job, RecoverRequest(), 2.0)
    assert sorted(rows.job_row(job)) == sorted(columns("jobs"))
    assert sorted(rows.rank_row(1, job.ranks, 0)) == sorted(columns("ranks"))
    assert sorted(rows.checkpoint_row(1, ck)) == sorted(columns("checkpoints"))
    assert sorted(rows.part_row(1, 1, Part(0, 1, 0.1, "m", 1.0))) == sorted(columns("parts"))
    assert sorted([*rows.event_row(1, changes.events[0]), "id"]) == sorted(columns("events"))
    job.ranks.iteration_s[0], job.ranks.node[0] = 0.5, "host"
    whole = rows.rank_row(7, job.ranks, 0)
    assert rows.heartbeat_row(7, job.ranks, 0) == (
        *(whole[c] for c in rows.HEARTBEAT_COLUMNS),
        7,
        0,
    )


def _stored_heartbeats(path: Path) -> list[tuple[int, float, int]]:
    """(rank, last_heartbeat, step) of every rank row, read by another connection."""
    with sqlite3.connect(path) as conn:
        sql = "SELECT rank, last_heartbeat, step FROM ranks ORDER BY rank"
        return [tuple(r) for r in conn.execute(sql).fetchall()]


def test_batched_heartbeats_are_held_until_a_flush_then_written_with_their_newest_values(
    tmp_path: Path,
) -> None:
    repo = Repository(tmp_path / "c.db", batch_heartbeats=True)
    job = play(repo)  # its heartbeats went with the part reports that followed them
    assert _stored_heartbeats(tmp_path / "c.db") == [(0, 3.0, 12), (1, 3.0, 12)]
    for t, step in ((7.0, 13), (8.0, 14)):
        repo.save(job, ranks.rank_heartbeat(job, 0, Heartbeat(generation=1, step=step), t)[1])
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=13), 8.5)[1])
    assert _stored_heartbeats(tmp_path / "c.db") == [(0, 3.0, 12), (1, 3.0, 12)]
    assert repo.flush_heartbeats() == 2
    assert _stored_heartbeats(tmp_path / "c.db") == [(0, 8.0, 14), (1, 8.5, 13)]
    assert repo.flush_heartbeats() == 0
    repo.close()
    (loaded,) = Repository(tmp_path / "c.db").load_jobs()
    assert ranks_of(loaded.ranks) == ranks_of(job.ranks)


def test_any_other_write_commits_the_held_heartbeats_with_it_and_close_flushes(
    tmp_path: Path,
) -> None:
    repo = Repository(tmp_path / "c.db", batch_heartbeats=True)
    job = play(repo)
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=15), 7.0)[1])
    # A part report is written at once, and the held rows with it.
    part = PartReport(generation=1, nbytes=9, duration_s=0.5, manifest_path="m0")
    repo.save(job, checkpoints.report_part(job, 30, 0, part, 7.5)[1])
    assert _stored_heartbeats(tmp_path / "c.db") == [(0, 3.0, 12), (1, 7.0, 15)]
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=16), 8.0)[1])
    repo.close()
    assert _stored_heartbeats(tmp_path / "c.db") == [(0, 3.0, 12), (1, 8.0, 16)]


def test_without_batching_every_heartbeat_is_committed_before_save_returns(
    tmp_path: Path,
) -> None:
    repo = Repository(tmp_path / "c.db")
    job = play(repo)
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=15), 7.0)[1])
    assert _stored_heartbeats(tmp_path / "c.db") == [(0, 3.0, 12), (1, 7.0, 15)]
    repo.close()
