"""Job leases: which replica serves each job, until when, under which epoch.

Revision ID: r0003
Revises: r0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0003"
down_revision = "r0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_leases",
        sa.Column("job_id", sa.Integer, primary_key=True),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("expires", sa.Float, nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_leases")
