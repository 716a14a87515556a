"""Insert-or-update by primary key, the same statement on SQLite and PostgreSQL, and the
fast way to run a statement for many rows.

Both dialects spell an upsert ``INSERT ... ON CONFLICT (key) DO UPDATE SET col =
excluded.col`` (what ``INSERT OR REPLACE`` was, without its delete-then-insert);
SQLAlchemy builds it from each dialect's own ``insert``. Cached per (dialect, table): it
runs on every write.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

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


def execute_rows(conn: Connection, stmt: sa.Executable, found: Sequence[Mapping[str, Any]]) -> None:
    """``stmt`` for each of ``found`` (rows with the same keys), as the driver's own
    executemany: compiled for ``conn``'s dialect once per (statement, keys), the values
    handed to the driver as they are. SQLAlchemy's execution path costs about as much as
    SQLite's write itself per statement; these rows hold only plain numbers and text."""
    if not found:
        return
    keys = tuple(found[0])
    sql, order = _compiled(stmt, conn.dialect, keys)
    if order is None:
        conn.exec_driver_sql(sql, list(found))
    else:
        conn.exec_driver_sql(sql, [tuple(row[k] for k in order) for row in found])


@functools.lru_cache(maxsize=256)
def _compiled(
    stmt: sa.Executable, dialect: sa.Dialect, keys: tuple[str, ...]
) -> tuple[str, tuple[str, ...] | None]:
    """``stmt``'s SQL in ``dialect`` for parameters ``keys``, and their order when the
    driver's are positional (SQLite's ``?``; None: named, psycopg's ``%(name)s``)."""
    compiled = stmt.compile(dialect=dialect, column_keys=list(keys))  # type: ignore[attr-defined]
    order = tuple(compiled.positiontup or ()) if compiled.positional else None
    return str(compiled), order
