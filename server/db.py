"""SQLite (WAL) store of the coordinator's state.

Every mutating request writes one small transaction on the event loop (sqlite3 directly,
never through the threadpool): with WAL and ``synchronous=NORMAL`` a commit costs tens of
microseconds and survives a SIGKILL of the process (only an OS crash could lose the last
transactions). The in-memory state in :mod:`checkflow_server.state` is loaded from here at
startup and written through on every change.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, storage_uri TEXT,
    world_size INTEGER NOT NULL, max_overhead REAL NOT NULL, heartbeat_timeout_s REAL NOT NULL,
    created REAL NOT NULL, generation INTEGER NOT NULL, generation_started REAL NOT NULL,
    recovering_since REAL, interval INTEGER NOT NULL, anchor INTEGER NOT NULL,
    prev_interval INTEGER, prev_anchor INTEGER, max_step INTEGER NOT NULL,
    failures INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS ranks (
    job_id INTEGER NOT NULL, rank INTEGER NOT NULL, generation INTEGER NOT NULL,
    state TEXT NOT NULL, instance TEXT, node TEXT, registered_at REAL, last_heartbeat REAL,
    step INTEGER, iteration_s REAL, stall_s REAL, persist_s REAL,
    PRIMARY KEY (job_id, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id INTEGER NOT NULL, step INTEGER NOT NULL, generation INTEGER NOT NULL,
    status TEXT NOT NULL, started REAL NOT NULL, committed_at REAL, committer INTEGER,
    nbytes INTEGER NOT NULL, source TEXT NOT NULL, persisted INTEGER NOT NULL,
    PRIMARY KEY (job_id, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS parts (
    job_id INTEGER NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL,
    nbytes INTEGER NOT NULL, duration_s REAL NOT NULL, manifest_path TEXT NOT NULL,
    reported_at REAL NOT NULL,
    PRIMARY KEY (job_id, step, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id INTEGER NOT NULL, time REAL NOT NULL,
    kind TEXT NOT NULL, generation INTEGER NOT NULL, rank INTEGER, detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
"""

JOB_COLUMNS = [
    "id", "name", "storage_uri", "world_size", "max_overhead", "heartbeat_timeout_s", "created",
    "generation", "generation_started", "recovering_since", "interval", "anchor",
    "prev_interval", "prev_anchor", "max_step", "failures",
]  # fmt: skip
RANK_COLUMNS = [
    "rank", "generation", "state", "instance", "node", "registered_at", "last_heartbeat",
    "step", "iteration_s", "stall_s", "persist_s",
]  # fmt: skip
CHECKPOINT_COLUMNS = [
    "step", "generation", "status", "started", "committed_at", "committer", "nbytes",
    "source", "persisted",
]  # fmt: skip
PART_COLUMNS = ["step", "rank", "nbytes", "duration_s", "manifest_path", "reported_at"]
EVENT_COLUMNS = ["id", "time", "kind", "generation", "rank", "detail"]


class Store:
    """The coordinator's SQLite database. Single-threaded: used from the event loop only."""

    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit is durable against a crash of this process (SIGKILL), which is
        # what the coordinator promises; FULL would add an fsync to every heartbeat.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=5000")
        self.conn.executescript(SCHEMA)
        self.path = str(path)
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None

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

    # --- reads (startup and listings) -------------------------------------------------
    def jobs(self) -> list[dict[str, Any]]:
        return self._rows(f"SELECT {', '.join(JOB_COLUMNS)} FROM jobs ORDER BY id", (), JOB_COLUMNS)

    def ranks(self, job_id: int) -> list[dict[str, Any]]:
        sql = f"SELECT {', '.join(RANK_COLUMNS)} FROM ranks WHERE job_id=? ORDER BY rank"
        return self._rows(sql, (job_id,), RANK_COLUMNS)

    def checkpoints(self, job_id: int) -> list[dict[str, Any]]:
        sql = (
            f"SELECT {', '.join(CHECKPOINT_COLUMNS)} FROM checkpoints WHERE job_id=? ORDER BY step"
        )
        return self._rows(sql, (job_id,), CHECKPOINT_COLUMNS)

    def parts(self, job_id: int, step: int) -> list[dict[str, Any]]:
        sql = f"SELECT {', '.join(PART_COLUMNS)} FROM parts WHERE job_id=? AND step=?"
        return self._rows(sql, (job_id, step), PART_COLUMNS)

    def events(self, job_id: int, *, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` events with id > ``after``, oldest first."""
        sql = (
            f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE job_id=? AND id>? "
            "ORDER BY id DESC LIMIT ?"
        )
        rows = self._rows(sql, (job_id, after, limit), EVENT_COLUMNS)
        for row in rows:
            row["detail"] = json.loads(row["detail"])
        return rows[::-1]

    def _rows(self, sql: str, args: tuple[Any, ...], columns: list[str]) -> list[dict[str, Any]]:
        return [dict(zip(columns, r, strict=True)) for r in self.conn.execute(sql, args)]

    # --- writes (call inside transaction()) --------------------------------------------
    def insert_job(self, row: dict[str, Any]) -> int:
        cols = [c for c in JOB_COLUMNS if c != "id"]
        cur = self.conn.execute(
            f"INSERT INTO jobs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
            [row[c] for c in cols],
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def update_job(self, row: dict[str, Any]) -> None:
        cols = [c for c in JOB_COLUMNS if c not in ("id", "name", "created")]
        self.conn.execute(
            f"UPDATE jobs SET {', '.join(c + '=?' for c in cols)} WHERE id=?",
            [row[c] for c in cols] + [row["id"]],
        )

    def upsert_ranks(self, job_id: int, rows: Iterable[dict[str, Any]]) -> None:
        self.conn.executemany(
            f"INSERT OR REPLACE INTO ranks (job_id, {', '.join(RANK_COLUMNS)}) "
            f"VALUES (?, {', '.join('?' * len(RANK_COLUMNS))})",
            ([job_id, *(r[c] for c in RANK_COLUMNS)] for r in rows),
        )

    def save_heartbeats(self, job_id: int, rows: Iterable[tuple[Any, ...]]) -> None:
        """Rows of (last_heartbeat, step, iteration_s, stall_s, persist_s, node, rank)."""
        self.conn.executemany(
            "UPDATE ranks SET last_heartbeat=?, step=?, iteration_s=?, stall_s=?, persist_s=?, "
            "node=? WHERE job_id=? AND rank=?",
            ((*r[:6], job_id, r[6]) for r in rows),
        )

    def set_rank_states(self, job_id: int, rows: Iterable[tuple[str, int]]) -> None:
        """Rows of (state, rank)."""
        self.conn.executemany(
            "UPDATE ranks SET state=? WHERE job_id=? AND rank=?",
            ((s, job_id, r) for s, r in rows),
        )

    def upsert_checkpoint(self, job_id: int, row: dict[str, Any]) -> None:
        self.conn.execute(
            f"INSERT OR REPLACE INTO checkpoints (job_id, {', '.join(CHECKPOINT_COLUMNS)}) "
            f"VALUES (?, {', '.join('?' * len(CHECKPOINT_COLUMNS))})",
            [job_id, *(row[c] for c in CHECKPOINT_COLUMNS)],
        )

    def insert_part(self, job_id: int, row: dict[str, Any]) -> None:
        self.conn.execute(
            f"INSERT OR REPLACE INTO parts (job_id, {', '.join(PART_COLUMNS)}) "
            f"VALUES (?, {', '.join('?' * len(PART_COLUMNS))})",
            [job_id, *(row[c] for c in PART_COLUMNS)],
        )

    def delete_parts(self, job_id: int, step: int) -> None:
        self.conn.execute("DELETE FROM parts WHERE job_id=? AND step=?", (job_id, step))

    def insert_event(
        self,
        job_id: int,
        time: float,
        kind: str,
        generation: int,
        rank: int | None,
        detail: dict[str, Any],
    ) -> int:
        cur = self.conn.execute(
            "INSERT INTO events (job_id, time, kind, generation, rank, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (job_id, time, kind, generation, rank, json.dumps(detail)),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid
