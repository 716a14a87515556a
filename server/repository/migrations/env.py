"""Alembic's environment: migrations run on the connection ``migrate.upgrade`` hands over.

There is no ``alembic.ini`` and no URL here: the coordinator migrates its own database at
start (``checkflow serve``), inside the transaction that holds the migration lock, so this
only runs the revisions on that connection.
"""

from __future__ import annotations

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
