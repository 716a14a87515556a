"""The repository: what the rules changed is written, and loads back as it was, on SQLite
and on a real PostgreSQL (``db_target``: one of each, ``tests/server/conftest.py``)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from checkflow_server.domain import checkpoints, jobs, ranks, tuning
from checkflow_server.domain.changes import Changes
from checkflow_server.domain.state import Checkpoint, Job, Part, RankTable
from checkflow_server.repository import Repository, migrate, rows, schema
from checkflow_server.repository.database import Database, engine_url

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
from tests.support.old_schema import PRE_ALEMBIC_SCHEMA


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


def test_a_saved_job_loads_back_as_it_was(db_target: str) -> None:
    repo = Repository(db_target)
    job = play(repo)
    repo.close()
    (loaded,) = Repository(db_target).load_jobs()
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
    old_schema = PRE_ALEMBIC_SCHEMA.replace(", kind TEXT,", ",")
    old_schema = old_schema.replace(", hang_timeout_s REAL", "")
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


def test_a_job_row_of_an_older_coordinator_without_a_mode_loads_as_auto(db_target: str) -> None:
    # An older coordinator retuned every job: its rows are every="auto" jobs.
    repo = Repository(db_target)
    play(repo)
    repo.close()
    with _engine(db_target).begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET interval_mode = NULL"))
    (loaded,) = Repository(db_target).load_jobs()
    assert loaded.schedule.mode == "warmup"


def test_events_are_the_newest_ones_oldest_first(db_target: str) -> None:
    repo = Repository(db_target)
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


def test_every_column_of_the_schema_is_mapped_and_nothing_else(db_target: str) -> None:
    # Adding a column means a migration, schema.py and the *_row mapping in rows.py: this
    # keeps the three from drifting apart, on each backend.
    Repository(db_target).close()
    inspector = sa.inspect(_engine(db_target))

    def columns(table: str) -> list[str]:
        migrated = sorted(c["name"] for c in inspector.get_columns(table))
        assert migrated == sorted(schema.metadata.tables[table].columns.keys())
        return migrated

    job, _ = jobs.create_job(JobCreate(name="j", world_size=1), 1.0, 10)
    ck = Checkpoint(step=1, generation=1, status=CheckpointStatus.COMMITTED, started=1.0)
    _, changes = jobs.recover(job, RecoverRequest(), 2.0)
    assert sorted(rows.job_row(job)) == columns("jobs")
    assert sorted(rows.rank_row(1, job.ranks, 0)) == columns("ranks")
    assert sorted(rows.checkpoint_row(1, ck)) == columns("checkpoints")
    assert sorted(rows.part_row(1, 1, Part(0, 1, 0.1, "m", 1.0))) == columns("parts")
    assert sorted([*rows.event_row(1, changes.events[0]), "id"]) == columns("events")
    assert columns("job_tokens") == ["created", "digest", "job"]
    assert columns("job_leases") == ["epoch", "expires", "job_id", "owner"]
    assert set(inspector.get_table_names()) == {*schema.metadata.tables, "alembic_version"}
    job.ranks.iteration_s[0], job.ranks.node[0] = 0.5, "host"
    whole = rows.rank_row(7, job.ranks, 0)
    assert rows.heartbeat_row(7, job.ranks, 0) == (
        *(whole[c] for c in rows.HEARTBEAT_COLUMNS),
        7,
        0,
    )


def _engine(target: str) -> sa.Engine:
    """Another connection to the same database, as another process would read it."""
    return sa.create_engine(engine_url(target))


def _stored_heartbeats(target: str) -> list[tuple[int, float, int]]:
    """(rank, last_heartbeat, step) of every rank row, read by another connection."""
    engine = _engine(target)
    try:
        with engine.connect() as conn:
            sql = sa.text("SELECT rank, last_heartbeat, step FROM ranks ORDER BY rank")
            return [(r[0], r[1], r[2]) for r in conn.execute(sql)]
    finally:
        engine.dispose()


def test_batched_heartbeats_are_held_until_a_flush_then_written_with_their_newest_values(
    db_target: str,
) -> None:
    repo = Repository(db_target, batch_heartbeats=True)
    job = play(repo)  # its heartbeats went with the part reports that followed them
    assert _stored_heartbeats(db_target) == [(0, 3.0, 12), (1, 3.0, 12)]
    for t, step in ((7.0, 13), (8.0, 14)):
        repo.save(job, ranks.rank_heartbeat(job, 0, Heartbeat(generation=1, step=step), t)[1])
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=13), 8.5)[1])
    assert _stored_heartbeats(db_target) == [(0, 3.0, 12), (1, 3.0, 12)]
    assert repo.flush_heartbeats() == 2
    assert _stored_heartbeats(db_target) == [(0, 8.0, 14), (1, 8.5, 13)]
    assert repo.flush_heartbeats() == 0
    repo.close()
    (loaded,) = Repository(db_target).load_jobs()
    assert ranks_of(loaded.ranks) == ranks_of(job.ranks)


def test_any_other_write_commits_the_held_heartbeats_with_it_and_close_flushes(
    db_target: str,
) -> None:
    repo = Repository(db_target, batch_heartbeats=True)
    job = play(repo)
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=15), 7.0)[1])
    # A part report is written at once, and the held rows with it.
    part = PartReport(generation=1, nbytes=9, duration_s=0.5, manifest_path="m0")
    repo.save(job, checkpoints.report_part(job, 30, 0, part, 7.5)[1])
    assert _stored_heartbeats(db_target) == [(0, 3.0, 12), (1, 7.0, 15)]
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=16), 8.0)[1])
    repo.close()
    assert _stored_heartbeats(db_target) == [(0, 3.0, 12), (1, 8.0, 16)]


def test_without_batching_every_heartbeat_is_committed_before_save_returns(
    db_target: str,
) -> None:
    repo = Repository(db_target)
    job = play(repo)
    repo.save(job, ranks.rank_heartbeat(job, 1, Heartbeat(generation=1, step=15), 7.0)[1])
    assert _stored_heartbeats(db_target) == [(0, 3.0, 12), (1, 7.0, 15)]
    repo.close()


def test_the_schema_migrates_once_and_records_its_revision(db_target: str) -> None:
    Repository(db_target).close()
    db = Database(db_target)
    assert migrate.current(db) == migrate.head() == migrate.HEAD
    migrate.upgrade(db)  # at its head: nothing to do
    db.close()


def test_two_coordinators_migrating_one_empty_database_at_once_both_start(
    db_target: str,
) -> None:
    # The migration lock (an advisory lock on PostgreSQL, BEGIN IMMEDIATE on SQLite): the
    # second waits for the first and finds the schema at its head.
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        try:
            start.wait()
            Repository(db_target).close()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    db = Database(db_target)
    assert migrate.current(db) == migrate.head()
    db.close()


def test_a_postgresql_url_without_a_database_name_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a database name"):
        engine_url("postgresql://u@127.0.0.1:5432")


def test_a_replica_that_lost_the_lease_writes_nothing_of_the_job(db_target: str) -> None:
    # Two replicas' repositories on one database: a creates the job (its lease, epoch 1);
    # the lease runs out, b takes it (epoch 2); a's next write is refused whole.
    from checkflow_server.repository.leases import LeaseLost

    a = Repository(db_target, owner="http://a:1")
    b = Repository(db_target, owner="http://b:1")
    assert a.leases is not None and b.leases is not None
    job = play(a)
    assert a.leases.takeable() == [] and b.leases.takeable() == []  # a's lease is live
    with _engine(db_target).begin() as conn:
        conn.execute(sa.text("UPDATE job_leases SET expires = 0"))
    [(job_id, lease)] = b.leases.takeable()
    assert lease is not None and (job_id, lease.owner, lease.epoch) == (job.id, "http://a:1", 1)
    assert b.leases.claim(job_id, lease) and not a.leases.claim(job_id, lease)  # one wins
    before = _stored_heartbeats(db_target)
    with pytest.raises(LeaseLost):
        a.save(job, ranks.rank_heartbeat(job, 0, Heartbeat(generation=1, step=99), 9.0)[1])
    with pytest.raises(LeaseLost):
        a.save(job, jobs.recover(job, RecoverRequest(), 9.5)[1])
    assert _stored_heartbeats(db_target) == before
    assert [e.kind for e in b.events(job)][-1] == "interval_changed"  # no rollback stored
    assert a.leases.renew() == set() and b.leases.renew() == set()
    assert b.leases.epochs == {job_id: 2} and a.leases.epochs == {}
    (loaded,) = b.load_jobs([job_id])
    assert loaded.generation == 1
    a.close()
    b.close()
