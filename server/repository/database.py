"""The coordinator's database: a SQLAlchemy engine on SQLite (the default) or PostgreSQL.

``--db`` is a path (SQLite, one machine, zero setup) or a ``postgresql://`` URL (several
replicas, see ``docs/ARCHITECTURE.md``). Every statement goes through SQLAlchemy Core, so
the same code runs on both; what differs is only set up here:

- SQLite: WAL and ``synchronous=NORMAL`` (a commit costs tens of microseconds and survives
  a SIGKILL of the process; only an OS crash could lose the last transactions), every
  transaction ``BEGIN IMMEDIATE`` (the write lock taken up front: two processes on one
  file serialize instead of failing a lock upgrade), WAL checkpoints in a thread.
- PostgreSQL: psycopg 3 (``pip install 'checkflow[postgres]'``); a connection the server
  dropped is discarded by the pool and the next transaction opens a new one.

Every transaction runs on the event loop (never the threadpool), as the rules do.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

logger = logging.getLogger(__name__)

POSTGRES_SCHEMES = ("postgresql://", "postgres://", "postgresql+psycopg://")


def is_postgres(target: str | Path) -> bool:
    """Whether ``--db`` names a PostgreSQL database (else it is a SQLite file's path)."""
    return str(target).startswith(POSTGRES_SCHEMES)


def engine_url(target: str | Path) -> URL:
    """The SQLAlchemy URL of ``--db``: a PostgreSQL URL on psycopg 3, or a SQLite path."""
    text = str(target)
    if is_postgres(text):
        url = make_url(text)
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")
        if not url.database:
            raise ValueError(
                "a PostgreSQL --db needs a database name: postgresql://USER@HOST:PORT/DBNAME"
            )
        return url
    return URL.create("sqlite", database=text)


def shown(target: str | Path) -> str:
    """``--db`` as logs may print it: a URL's password masked."""
    if is_postgres(target):
        return make_url(str(target)).render_as_string(hide_password=True)
    return str(target)


class Database:
    """One database: its engine, transactions, and the SQLite WAL checkpointer."""

    def __init__(self, target: str | Path) -> None:
        self.path = str(target)
        self.sqlite = not is_postgres(target)
        if self.sqlite and self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.engine = _sqlite_engine(self.path) if self.sqlite else _postgres_engine(target)
        self._conn: Connection | None = None
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One atomic unit: everything inside commits together or not at all.

        One connection, kept open (a pool checkout per transaction cost more than the
        transaction); one transaction at a time, all on the event loop. A connection the
        database dropped is invalidated by SQLAlchemy when its error is raised, and the
        next transaction opens a new one.
        """
        if self._conn is None:
            self._conn = self.engine.connect()
        conn = self._conn
        try:
            with conn.begin():
                yield conn
        except sa.exc.DBAPIError as e:
            if e.connection_invalidated:
                self._conn = None
                conn.close()
            raise

    def now(self, conn: Connection) -> float:
        """The database's clock (seconds since the epoch): leases are compared on it, so
        replicas whose clocks disagree still agree on when a lease ends."""
        if self.sqlite:  # one machine: its clock (SQLite 3.40 has no sub-second unixepoch)
            return time.time()
        sql = "SELECT extract(epoch FROM clock_timestamp())"
        return float(conn.exec_driver_sql(sql).scalar_one())

    def start_checkpointer(self, period_s: float = 1.0) -> None:
        """SQLite: move WAL checkpoints off the event loop, into a thread of its own.

        A checkpoint copies the WAL into the database and fsyncs it: SQLite's automatic
        one runs inside whichever commit crosses 1000 pages, and on a busy disk that fsync
        stalled the event loop for hundreds of milliseconds (every heartbeat waited). The
        thread's PASSIVE checkpoints never block writers; sqlite3 releases the GIL in them.
        """
        if not self.sqlite or self.path == ":memory:" or self._checkpointer is not None:
            return
        self._drop_connection()  # the next one is opened without automatic checkpoints
        self.engine.dispose()
        self.engine = _sqlite_engine(self.path, autocheckpoint=False)
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop,
            args=(period_s,),
            name="sqlite-checkpointer",
            daemon=True,
        )
        self._checkpointer.start()

    def _checkpoint_loop(self, period_s: float) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=5000")
        try:
            while not self._stop.wait(period_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as e:  # retried next period; the WAL only grows meanwhile
                    logger.warning("WAL checkpoint failed: %s", e)
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=10)
        self._drop_connection()
        self.engine.dispose()

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _sqlite_engine(path: str, *, autocheckpoint: bool = True) -> Engine:
    engine = sa.create_engine(engine_url(path), connect_args={"check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _setup(dbapi: Any, record: Any) -> None:
        # SQLite-only engine setup: SQLAlchemy's own BEGIN (below), WAL, durability.
        dbapi.isolation_level = None
        cur = dbapi.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit is durable against a crash of this process (SIGKILL), which is
        # what the coordinator promises; FULL would add an fsync to every heartbeat flush.
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=5000")
        if not autocheckpoint:
            cur.execute("PRAGMA wal_autocheckpoint=0")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # On the driver's connection: through SQLAlchemy's execution path this one
        # statement cost as much as the write it begins.
        conn.connection.driver_connection.execute("BEGIN IMMEDIATE")  # type: ignore[union-attr]

    return engine


def _postgres_engine(target: str | Path) -> Engine:
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "a postgresql:// --db needs the PostgreSQL driver: pip install 'checkflow[postgres]'"
        ) from e
    # A few connections: the event loop uses one at a time; the pool keeps one warm.
    # connect_timeout: a database that does not answer fails the request (503) in seconds
    # rather than stalling the event loop, and with it every heartbeat, for good.
    return sa.create_engine(
        engine_url(target),
        pool_size=2,
        max_overflow=2,
        pool_timeout=5,
        connect_args={"connect_timeout": 5},
    )
