"""The tables of the coordinator before Alembic, each made only where it is missing.

A database written by a coordinator before migrations existed already has them (and no
``alembic_version``): for it this revision does nothing, and ``r0002`` adds the columns it
may lack. A new database gets them here whole.

Revision ID: r0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0001"
down_revision = None
branch_labels = None
depends_on = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _tables() -> list[sa.Table]:
    m = sa.MetaData()
    return [*_job_tables(m), *_log_tables(m)]


def _job_tables(m: sa.MetaData) -> list[sa.Table]:
    return [
        sa.Table(
            "jobs", m,
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
        ),
        sa.Table(
            "ranks", m,
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
            sqlite_with_rowid=False,
        ),
    ]  # fmt: skip


def _log_tables(m: sa.MetaData) -> list[sa.Table]:
    return [
        sa.Table(
            "checkpoints", m,
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
            sqlite_with_rowid=False,
        ),
        sa.Table(
            "parts", m,
            sa.Column("job_id", sa.Integer, primary_key=True),
            sa.Column("step", sa.BigInteger, primary_key=True),
            sa.Column("rank", sa.Integer, primary_key=True),
            sa.Column("nbytes", sa.BigInteger, nullable=False),
            sa.Column("duration_s", sa.Float, nullable=False),
            sa.Column("manifest_path", sa.Text, nullable=False),
            sa.Column("reported_at", sa.Float, nullable=False),
            sqlite_with_rowid=False,
        ),
        sa.Table(
            "events", m,
            sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
            sa.Column("job_id", sa.Integer, nullable=False),
            sa.Column("time", sa.Float, nullable=False),
            sa.Column("kind", sa.Text, nullable=False),
            sa.Column("generation", sa.BigInteger, nullable=False),
            sa.Column("rank", sa.Integer),
            sa.Column("detail", sa.Text, nullable=False),
            sa.Index("events_by_job", "job_id", "id"),
            sqlite_autoincrement=True,
        ),
        sa.Table(
            "job_tokens", m,
            sa.Column("digest", sa.Text, primary_key=True),
            sa.Column("job", sa.Text, nullable=False),
            sa.Column("created", sa.Float, nullable=False),
        ),
    ]  # fmt: skip


def upgrade() -> None:
    bind = op.get_bind()
    have = set(sa.inspect(bind).get_table_names())
    for table in _tables():
        if table.name not in have:
            table.create(bind)


def downgrade() -> None:
    for table in reversed(_tables()):
        op.drop_table(table.name)
