"""All of the coordinator's SQL: loading jobs at startup, writing what a rule changed,
reading the event log. Rows are mapped in :mod:`.rows`."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import Job
from checkflow_server.repository import rows
from checkflow_server.repository.database import Database

from checkflow.protocol import CheckpointStatus, EventPublic


class Repository:
    """The coordinator's state in SQLite; the in-memory state is loaded from here at
    startup and written through, one transaction per decision."""

    def __init__(self, path: Path | str, *, batch_heartbeats: bool = False) -> None:
        self.db = Database(path, rows.SCHEMA)
        self._add_columns()
        self.batch_heartbeats = batch_heartbeats
        """Hold heartbeat-only writes for :meth:`flush_heartbeats` (see :meth:`save`)."""
        self._pending: dict[int, tuple[Job, set[int]]] = {}

    def _add_columns(self) -> None:
        """Bring a database of an older coordinator up to :data:`rows.ADDED_COLUMNS`."""
        for table, column, kind in rows.ADDED_COLUMNS:
            have = {r["name"] for r in self._rows(f"PRAGMA table_info({table})")}
            if column not in have:
                self.db.conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def start_checkpointer(self) -> None:
        """See :meth:`Database.start_checkpointer`."""
        self.db.start_checkpointer()

    def close(self) -> None:
        self.flush_heartbeats()
        self.db.close()

    # --- reads --------------------------------------------------------------------------
    def load_jobs(self) -> list[Job]:
        """Every job with its ranks and checkpoints (and the parts of unfinished ones)."""
        return [
            self._load(rows.job_from_row(row))
            for row in self._rows("SELECT * FROM jobs ORDER BY id")
        ]

    def _load(self, job: Job) -> Job:
        for row in self._rows("SELECT * FROM ranks WHERE job_id=?", job.id):
            if row["rank"] < job.world_size:
                rows.load_rank(job.ranks, row)
        for row in self._rows("SELECT * FROM checkpoints WHERE job_id=? ORDER BY step", job.id):
            ck = rows.checkpoint_from_row(row)
            if ck.status == CheckpointStatus.IN_PROGRESS:
                sql = "SELECT * FROM parts WHERE job_id=? AND step=?"
                for part_row in self._rows(sql, job.id, ck.step):
                    part = rows.part_from_row(part_row)
                    ck.parts[part.rank] = part
            job.checkpoints[ck.step] = ck
        sql = "SELECT * FROM events WHERE job_id=? AND generation=? AND kind IN (?, ?) ORDER BY id"
        kinds = (EventKind.GENERATION_STARTED, EventKind.TRAINED_AGAIN)
        events = self._rows(sql, job.id, job.generation, *kinds)
        job.recovery = rows.recovery_from_events(job, events)
        return job

    def _rows(self, sql: str, *args: object) -> list[sqlite3.Row]:
        return self.db.conn.execute(sql, args).fetchall()

    def events(
        self, job: Job, *, after: int = 0, limit: int = 100, kinds: Iterable[str] = ()
    ) -> list[EventPublic]:
        """The newest ``limit`` events of ``job`` with id > ``after`` (of ``kinds`` only,
        when given), oldest first."""
        wanted = sorted(set(kinds))
        of_kinds = f" AND kind IN ({', '.join('?' * len(wanted))})" if wanted else ""
        sql = f"SELECT * FROM events WHERE job_id=? AND id>?{of_kinds} ORDER BY id DESC LIMIT ?"
        found = self._rows(sql, job.id, after, *wanted, limit)
        return [rows.event_from_row(row) for row in reversed(found)]

    # --- writes -------------------------------------------------------------------------
    def save(self, job: Job, changes: Changes) -> None:
        """Write what one decision changed, in one transaction. A new job gets its id.

        With ``batch_heartbeats``, a change that is only heartbeat fields (time, step,
        measurements, node of ranks that stay alive) is held until the next
        :meth:`flush_heartbeats` or the next other write, whichever comes first, and written
        with it: one commit for many heartbeats. A SIGKILL loses at most the heartbeat
        fields of that window, which is harmless: a restarted coordinator gives every alive
        rank a fresh grace period (it never reads a stored heartbeat time to judge
        silence), the stored steps and measurements are already older than the ranks' by
        the whole downtime, and every rank's next heartbeat overwrites them. Everything
        else (registrations, failures, aborts, events, checkpoints, job fields) is written
        before the request is answered, as without batching.
        """
        if not changes.writes():
            return
        if self.batch_heartbeats and _only_heartbeats(changes) and job.id is not None:
            self._pending.setdefault(job.id, (job, set()))[1].update(changes.heartbeats)
            return
        with self.db.transaction() as conn:
            held = self._write_pending(conn)
            if changes.created or changes.job:
                row = rows.job_row(job)
                if changes.created:
                    row["id"] = None  # SQLite assigns it
                cur = conn.execute(_upsert("jobs", tuple(row)), row)
                if changes.created:
                    assert cur.lastrowid is not None
                    job.id = cur.lastrowid
            self._save_ranks(conn, job, changes)
            for ck in changes.checkpoints.values():
                row = rows.checkpoint_row(job.id, ck)
                conn.execute(_upsert("checkpoints", tuple(row)), row)
            for step in changes.parts_cleared:
                conn.execute("DELETE FROM parts WHERE job_id=? AND step=?", (job.id, step))
            for step, part in changes.parts:
                row = rows.part_row(job.id, step, part)
                conn.execute(_upsert("parts", tuple(row)), row)
            for event in changes.events:
                row = rows.event_row(job.id, event)
                conn.execute(_insert("events", tuple(row)), row)
        if held:
            self._pending.clear()  # committed (a failed write keeps them held)

    def flush_heartbeats(self) -> int:
        """Write the held heartbeat fields in one transaction; how many rank rows."""
        if not self._pending:
            return 0
        with self.db.transaction() as conn:
            held = self._write_pending(conn)
        self._pending.clear()  # committed (a failed write keeps them held)
        return held

    def _write_pending(self, conn: sqlite3.Connection) -> int:
        """The held heartbeat rows, with the fields' values now (the newest heartbeat)."""
        beats = [
            rows.heartbeat_row(job.id, job.ranks, r)
            for job, ranks in self._pending.values()
            for r in sorted(ranks)
            if r < job.world_size  # a resize since: the rank row is gone
        ]
        if beats:
            conn.executemany(_HEARTBEAT_SQL, beats)
        return len(beats)

    @staticmethod
    def _save_ranks(conn: sqlite3.Connection, job: Job, changes: Changes) -> None:
        t = job.ranks
        if changes.ranks_cleared:
            conn.execute("DELETE FROM ranks WHERE job_id=?", (job.id,))
        if changes.heartbeats:
            beats = [rows.heartbeat_row(job.id, t, r) for r in changes.heartbeats]
            conn.executemany(_HEARTBEAT_SQL, beats)
        if changes.ranks:
            whole = [rows.rank_row(job.id, t, r) for r in changes.ranks]
            conn.executemany(_upsert("ranks", tuple(whole[0])), whole)


def _only_heartbeats(c: Changes) -> bool:
    """Whether ``c`` writes nothing but heartbeat fields (what may be batched)."""
    return bool(c.heartbeats) and not (
        c.created
        or c.job
        or c.ranks_cleared
        or c.ranks
        or c.checkpoints
        or c.parts_cleared
        or c.parts
        or c.events
    )


@functools.cache
def _upsert(table: str, columns: tuple[str, ...]) -> str:
    return _insert(table, columns).replace("INSERT", "INSERT OR REPLACE", 1)


@functools.cache
def _insert(table: str, columns: tuple[str, ...]) -> str:
    names = ", ".join(columns)
    values = ", ".join(f":{c}" for c in columns)
    return f"INSERT INTO {table} ({names}) VALUES ({values})"


_HEARTBEAT_SQL = (
    "UPDATE ranks SET "
    + ", ".join(f"{c}=?" for c in rows.HEARTBEAT_COLUMNS)
    + " WHERE job_id=? AND rank=?"
)
