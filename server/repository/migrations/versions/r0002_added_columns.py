"""The columns the coordinator added before Alembic, on a database that lacks them.

They used to be added at every start by ``ALTER TABLE ... ADD COLUMN`` from a list in
``rows.py`` (``ADDED_COLUMNS``); a database of any older coordinator holds some of them,
so each is added only where it is missing (NULL in existing rows, which ``rows.py`` reads
as the older coordinator meant it). An old ``jobs`` table's ``prev_interval`` and
``prev_anchor`` stay, unread and unwritten. A database made by ``r0001`` has them all.

Revision ID: r0002
Revises: r0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0002"
down_revision = "r0001"
branch_labels = None
depends_on = None

ADDED = (
    ("jobs", "hang_timeout_s", sa.Float),
    ("checkpoints", "kind", sa.Text),
    ("jobs", "interval_mode", sa.Text),
    ("jobs", "state", sa.Text),
    ("jobs", "rollback_step", sa.BigInteger),
)


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    for table, column, kind in ADDED:
        if column not in {c["name"] for c in inspector.get_columns(table)}:
            op.add_column(table, sa.Column(column, kind))


def downgrade() -> None:
    """Nothing: ``r0001`` makes these columns on a new database."""
