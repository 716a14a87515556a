"""The coordinator's tables as SQLAlchemy Core objects: what every statement is built from.

These describe the schema the migrations (``migrations/versions``) produce; the migrations
hold their own copy of each table's DDL, frozen at the revision that made it, so this module
may change with the next revision without rewriting history. ``tests/server/test_repository``
checks the two agree on every backend.

Types are portable: ``BigInteger`` wherever a count or a step may pass 2**31 (PostgreSQL's
``integer`` is 32-bit; SQLite's is 64-bit anyway), ``Float`` (a double on both) for times.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
"""An event id: SQLite's AUTOINCREMENT needs exactly ``INTEGER PRIMARY KEY``."""

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.Text, unique=True, nullable=False),
    sa.Column("storage_uri", sa.Text),
    sa.Column("world_size", sa.Integer, nullable=False),
    sa.Column("max_overhead", sa.Float, nullable=False),
    sa.Column("heartbeat_timeout_s", sa.Float, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("generation_started", sa.Float, nullable=False),
    sa.Column("recovering_since", sa.Float),
    sa.Column("interval", sa.BigInteger, nullable=False),
    sa.Column("anchor", sa.BigInteger, nullable=False),
    sa.Column("max_step", sa.BigInteger, nullable=False),
    sa.Column("failures", sa.BigInteger, nullable=False),
    sa.Column("hang_timeout_s", sa.Float),
    sa.Column("interval_mode", sa.Text),
    sa.Column("state", sa.Text),
    sa.Column("rollback_step", sa.BigInteger),
)

ranks = sa.Table(
    "ranks",
    metadata,
    sa.Column("job_id", sa.Integer, primary_key=True),
    sa.Column("rank", sa.Integer, primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("instance", sa.Text),
    sa.Column("node", sa.Text),
    sa.Column("registered_at", sa.Float),
    sa.Column("last_heartbeat", sa.Float),
    sa.Column("step", sa.BigInteger),
    sa.Column("iteration_s", sa.Float),
    sa.Column("stall_s", sa.Float),
    sa.Column("persist_s", sa.Float),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("job_id", sa.Integer, primary_key=True),
    sa.Column("step", sa.BigInteger, primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("started", sa.Float, nullable=False),
    sa.Column("committed_at", sa.Float),
    sa.Column("committer", sa.Integer),
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("persisted", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.Text),
)

parts = sa.Table(
    "parts",
    metadata,
    sa.Column("job_id", sa.Integer, primary_key=True),
    sa.Column("step", sa.BigInteger, primary_key=True),
    sa.Column("rank", sa.Integer, primary_key=True),
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("duration_s", sa.Float, nullable=False),
    sa.Column("manifest_path", sa.Text, nullable=False),
    sa.Column("reported_at", sa.Float, nullable=False),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("id", _BIG, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("rank", sa.Integer),
    sa.Column("detail", sa.Text, nullable=False),
    sa.Index("events_by_job", "job_id", "id"),
    sqlite_autoincrement=True,
)

job_tokens = sa.Table(
    "job_tokens",
    metadata,
    sa.Column("digest", sa.Text, primary_key=True),
    sa.Column("job", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
)

job_leases = sa.Table(
    "job_leases",
    metadata,
    sa.Column("job_id", sa.Integer, primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("expires", sa.Float, nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
)
"""Which replica serves a job (its advertised URL), until when, under which epoch: see
``domain/ownership.py`` for the rules and ``repository/leases.py`` for the statements."""
