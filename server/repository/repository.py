"""All of the coordinator's statements: loading jobs, writing what a rule changed, reading
the event log. Rows are mapped in :mod:`.rows`, tables described in :mod:`.schema`."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import sqlalchemy as sa
from checkflow_server.domain.changes import Changes, EventKind
from checkflow_server.domain.state import Job
from checkflow_server.repository import migrate, rows
from checkflow_server.repository.database import Database
from checkflow_server.repository.leases import Leases
from checkflow_server.repository.schema import checkpoints, events, jobs, parts, ranks
from checkflow_server.repository.upsert import execute_rows, upsert
from sqlalchemy.engine import Connection

from checkflow.protocol import CheckpointStatus, EventPublic

logger = logging.getLogger(__name__)


class Repository:
    """The coordinator's state in its database; the in-memory state is loaded from here and
    written through, one transaction per decision."""

    def __init__(
        self, target: Path | str, *, batch_heartbeats: bool = False, owner: str | None = None
    ) -> None:
        """``owner``: this replica's advertised URL when jobs are held by lease (several
        replicas on PostgreSQL): every write is then fenced by the job's lease
        (:class:`.Leases`); None: this process serves every job (SQLite, one process)."""
        self.db = Database(target)
        migrate.upgrade(self.db)
        self.leases = Leases(self.db, owner) if owner is not None else None
        self.batch_heartbeats = batch_heartbeats
        """Hold heartbeat-only writes for :meth:`flush_heartbeats` (see :meth:`save`)."""
        self._pending: dict[int, tuple[Job, set[int]]] = {}

    def start_checkpointer(self) -> None:
        """See :meth:`Database.start_checkpointer`."""
        self.db.start_checkpointer()

    def close(self) -> None:
        """Write what is held and close; a database that is gone loses only heartbeat
        fields (harmless: see :meth:`save`), so shutting down still succeeds."""
        try:
            self.flush_heartbeats()
        except sa.exc.SQLAlchemyError as e:
            logger.warning("held heartbeats not written at shutdown: %s", e)
        finally:
            self.db.close()

    # --- reads --------------------------------------------------------------------------
    def load_jobs(self, ids: Iterable[int] | None = None) -> list[Job]:
        """Every job (or those of ``ids``) with its ranks and checkpoints (and the parts of
        unfinished ones)."""
        query = sa.select(jobs).order_by(jobs.c.id)
        if ids is not None:
            query = query.where(jobs.c.id.in_(list(ids)))
        with self.db.transaction() as conn:
            found = conn.execute(query).mappings().all()
            return [self._load(conn, rows.job_from_row(row)) for row in found]

    def job_id(self, name: str) -> int | None:
        """The id of the job named ``name`` in the database; None: no such job."""
        with self.db.transaction() as conn:
            found = conn.execute(sa.select(jobs.c.id).where(jobs.c.name == name)).scalar()
            return int(found) if found is not None else None

    @staticmethod
    def _load(conn: Connection, job: Job) -> Job:
        for row in conn.execute(sa.select(ranks).where(ranks.c.job_id == job.id)).mappings():
            if row["rank"] < job.world_size:
                rows.load_rank(job.ranks, row)
        of_job = sa.select(checkpoints).where(checkpoints.c.job_id == job.id)
        for row in conn.execute(of_job.order_by(checkpoints.c.step)).mappings():
            ck = rows.checkpoint_from_row(row)
            if ck.status == CheckpointStatus.IN_PROGRESS:
                of_step = sa.select(parts).where(parts.c.job_id == job.id, parts.c.step == ck.step)
                for part_row in conn.execute(of_step).mappings():
                    part = rows.part_from_row(part_row)
                    ck.parts[part.rank] = part
            job.checkpoints[ck.step] = ck
        kinds = (EventKind.GENERATION_STARTED, EventKind.TRAINED_AGAIN)
        query = sa.select(events).where(
            events.c.job_id == job.id,
            events.c.generation == job.generation,
            events.c.kind.in_([str(k) for k in kinds]),
        )
        found = conn.execute(query.order_by(events.c.id)).mappings().all()
        job.recovery = rows.recovery_from_events(job, found)
        return job

    def events(
        self, job: Job, *, after: int = 0, limit: int = 100, kinds: Iterable[str] = ()
    ) -> list[EventPublic]:
        """The newest ``limit`` events of ``job`` with id > ``after`` (of ``kinds`` only,
        when given), oldest first."""
        wanted = sorted(set(kinds))
        query = sa.select(events).where(events.c.job_id == job.id, events.c.id > after)
        if wanted:
            query = query.where(events.c.kind.in_(wanted))
        query = query.order_by(events.c.id.desc()).limit(limit)
        with self.db.transaction() as conn:
            found = conn.execute(query).mappings().all()
        return [rows.event_from_row(row) for row in reversed(found)]

    # --- writes -------------------------------------------------------------------------
    def save(self, job: Job, changes: Changes) -> None:
        """Write what one decision changed, in one transaction. A new job gets its id (and,
        with leases, its lease: this replica serves it).

        With ``batch_heartbeats``, a change that is only heartbeat fields (time, step,
        measurements, node of ranks that stay alive) is held until the next
        :meth:`flush_heartbeats` or the next other write, whichever comes first, and written
        with it: one commit for many heartbeats. A SIGKILL loses at most the heartbeat
        fields of that window, which is harmless: a restarted coordinator (or the replica
        taking the job over) gives every alive rank a fresh grace period (it never reads a
        stored heartbeat time to judge silence), the stored steps and measurements are
        already older than the ranks' by the whole downtime, and every rank's next
        heartbeat overwrites them. Everything else (registrations, failures, aborts,
        events, checkpoints, job fields) is written before the request is answered.

        With leases, the transaction first checks that this replica still holds the job's
        lease under the epoch it took it with (:meth:`.Leases.fence`): a replica that lost
        the job writes nothing of it (``LeaseLost``).
        """
        if not changes.writes():
            return
        if self.batch_heartbeats and _only_heartbeats(changes) and job.id is not None:
            self._pending.setdefault(job.id, (job, set()))[1].update(changes.heartbeats)
            return
        with self.db.transaction() as conn:
            if self.leases is not None and not changes.created:
                assert job.id is not None
                self.leases.fence(conn, job.id, job.name)
            held = self._write_pending(conn)
            if changes.created:
                row = rows.job_row(job)
                del row["id"]  # the database assigns it
                key = conn.execute(jobs.insert().values(row)).inserted_primary_key
                assert key is not None
                job.id = int(key[0])
                if self.leases is not None:
                    self.leases.create(conn, job.id)
            elif changes.job:
                conn.execute(jobs.update().where(jobs.c.id == job.id).values(rows.job_row(job)))
            self._save_ranks(conn, job, changes)
            self._save_checkpoints(conn, job, changes)
        if held:
            self._pending.clear()  # committed (a failed write keeps them held)

    def flush_heartbeats(self) -> int:
        """Write the held heartbeat fields in one transaction; how many rank rows. With
        leases, the rows of a job this replica no longer holds are dropped, not written."""
        if not self._pending:
            return 0
        with self.db.transaction() as conn:
            if self.leases is not None:
                held = self.leases.held(conn, self._pending)
                for job_id in set(self._pending) - held:
                    del self._pending[job_id]
            count = self._write_pending(conn)
        self._pending.clear()  # committed (a failed write keeps them held)
        return count

    def forget(self, job: Job) -> None:
        """Drop what is held of ``job`` (this replica no longer serves it)."""
        if job.id is not None:
            self._pending.pop(job.id, None)

    def _write_pending(self, conn: Connection) -> int:
        """The held heartbeat rows, with the fields' values now (the newest heartbeat)."""
        beats = [
            rows.heartbeat_row(job.id, job.ranks, r)
            for job, held in self._pending.values()
            for r in sorted(held)
            if r < job.world_size  # a resize since: the rank row is gone
        ]
        if beats:
            _heartbeats(conn, beats)
        return len(beats)

    @staticmethod
    def _save_ranks(conn: Connection, job: Job, changes: Changes) -> None:
        t = job.ranks
        assert job.id is not None
        if changes.ranks_cleared:
            conn.execute(ranks.delete().where(ranks.c.job_id == job.id))
        if changes.heartbeats:
            _heartbeats(conn, [rows.heartbeat_row(job.id, t, r) for r in changes.heartbeats])
        if changes.ranks:
            whole = [rows.rank_row(job.id, t, r) for r in changes.ranks]
            execute_rows(conn, upsert(conn, ranks), whole)

    @staticmethod
    def _save_checkpoints(conn: Connection, job: Job, changes: Changes) -> None:
        assert job.id is not None
        if changes.checkpoints:
            ckpts = [rows.checkpoint_row(job.id, ck) for ck in changes.checkpoints.values()]
            execute_rows(conn, upsert(conn, checkpoints), ckpts)
        for step in changes.parts_cleared:
            conn.execute(parts.delete().where(parts.c.job_id == job.id, parts.c.step == step))
        if changes.parts:
            reported = [rows.part_row(job.id, step, part) for step, part in changes.parts]
            execute_rows(conn, upsert(conn, parts), reported)
        if changes.events:
            execute_rows(conn, _EVENT, [rows.event_row(job.id, e) for e in changes.events])


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


_HEARTBEAT = (
    ranks.update()
    .where(ranks.c.job_id == sa.bindparam("b_job_id"), ranks.c.rank == sa.bindparam("b_rank"))
    .values({c: sa.bindparam(c) for c in rows.HEARTBEAT_COLUMNS})
)
"""One rank's heartbeat fields (:data:`rows.HEARTBEAT_COLUMNS`), run for many at once."""

_EVENT = events.insert()

_KEYS = (*rows.HEARTBEAT_COLUMNS, "b_job_id", "b_rank")


def _heartbeats(conn: Connection, beats: Sequence[Sequence[object]]) -> None:
    """:data:`_HEARTBEAT` for many ranks (``rows.heartbeat_row`` tuples)."""
    execute_rows(conn, _HEARTBEAT, [dict(zip(_KEYS, b, strict=True)) for b in beats])
