"""Insert-or-update by primary key, the same statement on SQLite and PostgreSQL.

Both dialects spell it ``INSERT ... ON CONFLICT (key) DO UPDATE SET col = excluded.col``
(what ``INSERT OR REPLACE`` was, without its delete-then-insert); SQLAlchemy builds it
from each dialect's own ``insert``. Cached per (dialect, table): it runs on every write.
"""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection


def upsert(conn: Connection, table: sa.Table) -> sa.Insert:
    """The upsert of whole rows of ``table`` on ``conn``'s dialect."""
    return _upsert(conn.dialect.name, table)


@functools.cache
def _upsert(dialect: str, table: sa.Table) -> sa.Insert:
    keys = [c.name for c in table.primary_key.columns]
    if dialect == "postgresql":
        pg = postgresql.insert(table)
        rest = {c.name: pg.excluded[c.name] for c in table.columns if c.name not in keys}
        return pg.on_conflict_do_update(index_elements=keys, set_=rest)
    lite = sqlite.insert(table)
    rest = {c.name: lite.excluded[c.name] for c in table.columns if c.name not in keys}
    return lite.on_conflict_do_update(index_elements=keys, set_=rest)
