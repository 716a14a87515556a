"""The schema of the coordinator before Alembic (``rows.SCHEMA`` until issue 33), frozen:
the tests make databases of older coordinators from it and check they migrate."""

from __future__ import annotations

PRE_ALEMBIC_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, storage_uri TEXT,
    world_size INTEGER NOT NULL, max_overhead REAL NOT NULL, heartbeat_timeout_s REAL NOT NULL,
    created REAL NOT NULL, generation INTEGER NOT NULL, generation_started REAL NOT NULL,
    recovering_since REAL, interval INTEGER NOT NULL, anchor INTEGER NOT NULL,
    max_step INTEGER NOT NULL, failures INTEGER NOT NULL, hang_timeout_s REAL,
    interval_mode TEXT, state TEXT, rollback_step INTEGER
);
CREATE TABLE IF NOT EXISTS ranks (
    job_id INTEGER NOT NULL, rank INTEGER NOT NULL, generation INTEGER NOT NULL,
    state TEXT NOT NULL, instance TEXT, node TEXT, registered_at REAL, last_heartbeat REAL,
    step INTEGER, iteration_s REAL, stall_s REAL, persist_s REAL,
    PRIMARY KEY (job_id, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id INTEGER NOT NULL, step INTEGER NOT NULL, generation INTEGER NOT NULL,
    status TEXT NOT NULL, started REAL NOT NULL, committed_at REAL, committer INTEGER,
    nbytes INTEGER NOT NULL, source TEXT NOT NULL, persisted INTEGER NOT NULL, kind TEXT,
    PRIMARY KEY (job_id, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS parts (
    job_id INTEGER NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL,
    nbytes INTEGER NOT NULL, duration_s REAL NOT NULL, manifest_path TEXT NOT NULL,
    reported_at REAL NOT NULL,
    PRIMARY KEY (job_id, step, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id INTEGER NOT NULL, time REAL NOT NULL,
    kind TEXT NOT NULL, generation INTEGER NOT NULL, rank INTEGER, detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
"""
