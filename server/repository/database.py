"""The SQLite (WAL) connection of the coordinator: pragmas, transactions, WAL checkpoints.

Every mutating request writes one small transaction on the event loop (sqlite3 directly,
never through the threadpool): with WAL and ``synchronous=NORMAL`` a commit costs tens of
microseconds and survives a SIGKILL of the process (only an OS crash could lose the last
transactions).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


class Database:
    """One SQLite database with ``schema`` applied. Single-threaded: the event loop's."""

    def __init__(self, path: Path | str, schema: str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit is durable against a crash of this process (SIGKILL), which is
        # what the coordinator promises; FULL would add an fsync to every heartbeat.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=5000")
        self.conn.executescript(schema)
        self.path = str(path)
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic write: everything inside commits together or not at all."""
        self.conn.execute("BEGIN")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def start_checkpointer(self, period_s: float = 1.0) -> None:
        """Move WAL checkpoints off the event loop, into a thread with its own connection.

        A checkpoint copies the WAL into the database and fsyncs it: SQLite's automatic
        one runs inside whichever commit crosses 1000 pages, and on a busy disk that fsync
        stalled the event loop for hundreds of milliseconds (every heartbeat waited). The
        thread's PASSIVE checkpoints never block writers; sqlite3 releases the GIL in them.
        """
        if self.path == ":memory:" or self._checkpointer is not None:
            return
        self.conn.execute("PRAGMA wal_autocheckpoint=0")
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
        self.conn.close()
