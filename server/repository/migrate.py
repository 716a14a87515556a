"""Bring a database to the newest schema, under a lock: ``checkflow serve`` does it at start.

Two replicas starting together on an empty PostgreSQL database must not both create the
tables: the migration runs in one transaction holding a transaction-level advisory lock
(``pg_advisory_xact_lock``), so the second waits, then finds the schema at its head and
does nothing. On SQLite the transaction is ``BEGIN IMMEDIATE`` (``database.py``): the
write lock, taken before anything is read, serializes two processes the same way. DDL is
transactional on both, so a migration that fails leaves nothing half done.

The revisions live in ``migrations/versions`` inside the package, so an installed wheel
migrates without a source tree or an ``alembic.ini``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from checkflow_server.repository.database import Database
from sqlalchemy.engine import Connection

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).parent / "migrations"

LOCK_KEY = 0x636B666C6F77
"""The advisory lock's key ("ckflow"): one per database, held only while migrating."""


HEAD = "r0003"
"""The newest revision (``tests/server/test_repository.py`` checks it is Alembic's head):
a database already there is opened without importing Alembic, a third of a second of
every start on a loaded machine."""


def _config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def head() -> str:
    """The newest revision of ``migrations/versions``, as Alembic reads it."""
    from alembic.script import ScriptDirectory

    found = ScriptDirectory.from_config(_config()).get_current_head()
    assert found is not None
    return found


def upgrade(db: Database) -> None:
    """Migrate ``db`` to :data:`HEAD` under the lock (a no-op when it is there already)."""
    with db.transaction() as conn:
        if not db.sqlite:
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({LOCK_KEY})")
        if _stored(conn) == HEAD:
            return
        # Alembic's INFO lines name each plugin it sets up as it is imported (a dozen lines
        # of noise at a first start); its "Running upgrade ..." lines, which say what
        # changed, stay.
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
        from alembic import command

        config = _config()
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


def current(db: Database) -> str | None:
    """The revision ``db`` is at (None: not migrated)."""
    with db.transaction() as conn:
        return _stored(conn)


def _stored(conn: Connection) -> str | None:
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    found = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    return None if found is None else str(found)
