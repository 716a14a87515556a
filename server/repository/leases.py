"""The statements of job leases (rules: ``domain/ownership.py``).

Every time is the database's clock (:meth:`Database.now`), so replicas on hosts whose
clocks disagree still agree on when a lease ends. :class:`Leases` remembers the epoch this
replica took each job under: the fence of every write of the job.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa
from checkflow_server.domain import ownership
from checkflow_server.domain.ownership import Lease
from checkflow_server.repository.database import Database
from checkflow_server.repository.schema import job_leases, jobs
from sqlalchemy.engine import Connection


class LeaseLost(RuntimeError):
    """A write of a job this replica no longer holds: refused, nothing written."""


class Leases:
    """This replica's leases (``owner``: its advertised URL)."""

    def __init__(self, db: Database, owner: str) -> None:
        self.db = db
        self.owner = owner
        self.epochs: dict[int, int] = {}
        """job id -> the epoch this replica holds it under."""

    def create(self, conn: Connection, job_id: int) -> None:
        """The lease of a job created here, in the transaction that creates it."""
        expires = self.db.now(conn) + ownership.TTL_S
        conn.execute(
            job_leases.insert().values(job_id=job_id, owner=self.owner, expires=expires, epoch=1)
        )
        self.epochs[job_id] = 1

    def fence(self, conn: Connection, job_id: int, name: str) -> None:
        """Refuse (``LeaseLost``) a write of ``job_id`` unless this replica holds its lease
        under the epoch it took. ``FOR UPDATE``: a take-over waits for this transaction, so
        nothing is written under an epoch that has just ended."""
        query = sa.select(job_leases).where(job_leases.c.job_id == job_id).with_for_update()
        row = conn.execute(query).mappings().first()
        lease = Lease(**row) if row is not None else None
        if not ownership.holds(lease, self.owner, self.epochs.get(job_id)):
            self.epochs.pop(job_id, None)
            raise LeaseLost(f"job {name!r} is now served by another replica")

    def held(self, conn: Connection, job_ids: Iterable[int]) -> set[int]:
        """Those of ``job_ids`` this replica still holds (the heartbeat flush's fence)."""
        wanted = list(job_ids)
        query = sa.select(job_leases).where(job_leases.c.job_id.in_(wanted)).with_for_update()
        found = [Lease(**row) for row in conn.execute(query).mappings()]
        return {
            lease.job_id
            for lease in found
            if ownership.holds(lease, self.owner, self.epochs.get(lease.job_id))
        }

    def renew(self) -> set[int]:
        """Extend every lease this replica holds; the job ids it turned out to have lost."""
        with self.db.transaction() as conn:
            expires = self.db.now(conn) + ownership.TTL_S
            query = (
                job_leases.update()
                .where(job_leases.c.owner == self.owner)
                .values(expires=expires)
                .returning(job_leases.c.job_id, job_leases.c.epoch)
            )
            renewed = {int(r.job_id): int(r.epoch) for r in conn.execute(query)}
        gone = ownership.lost(self.epochs, renewed)
        for job_id in gone:
            self.epochs.pop(job_id, None)
        return gone

    def lookup(self, name: str) -> tuple[int, Lease | None, float] | None:
        """The job named ``name``: its id, its lease (None: none), the database's time
        now; None: no such job."""
        query = (
            sa.select(jobs.c.id, job_leases)
            .select_from(jobs.outerjoin(job_leases, job_leases.c.job_id == jobs.c.id))
            .where(jobs.c.name == name)
        )
        with self.db.transaction() as conn:
            row = conn.execute(query).mappings().first()
            now = self.db.now(conn)
        if row is None:
            return None
        return int(row["id"]), _lease(row), now

    def takeable(self) -> list[tuple[int, Lease | None]]:
        """Every job this replica may take now (``ownership.route`` says TAKE) and does not
        hold: no lease, expired, or this replica's own URL from before a restart."""
        query = sa.select(jobs.c.id, job_leases).select_from(
            jobs.outerjoin(job_leases, job_leases.c.job_id == jobs.c.id)
        )
        with self.db.transaction() as conn:
            now = self.db.now(conn)
            found = conn.execute(query).mappings().all()
        out = []
        for row in found:
            job_id, lease = int(row["id"]), _lease(row)
            if job_id in self.epochs:
                continue
            if ownership.route(lease, self.owner, now) == ownership.Route.TAKE:
                out.append((job_id, lease))
        return out

    def claim(self, job_id: int, seen: Lease | None) -> bool:
        """Take ``job_id``'s lease from ``seen`` (as read): True when this replica won it
        (the row was still as seen: no other replica took it meanwhile)."""
        epoch = ownership.next_epoch(seen)
        with self.db.transaction() as conn:
            expires = self.db.now(conn) + ownership.TTL_S
            values = {"owner": self.owner, "expires": expires, "epoch": epoch}
            stmt: sa.Insert | sa.Update
            if seen is None:
                stmt = upsert_nothing(conn).values(job_id=job_id, **values)
            else:
                stmt = (
                    job_leases.update()
                    .where(job_leases.c.job_id == job_id, job_leases.c.epoch == seen.epoch)
                    .values(values)
                )
            won = conn.execute(stmt).rowcount == 1
        if won:
            self.epochs[job_id] = epoch
        return won

    def release(self, job_id: int) -> None:
        """Forget ``job_id`` here (lost, or dropped after a failed write)."""
        self.epochs.pop(job_id, None)


def upsert_nothing(conn: Connection) -> sa.Insert:
    """``INSERT ... ON CONFLICT DO NOTHING`` into the leases (a race for a job without one:
    one replica inserts, the other's row count is 0)."""
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(job_leases).on_conflict_do_nothing(index_elements=["job_id"])


def _lease(row: sa.RowMapping) -> Lease | None:
    if row["owner"] is None:
        return None
    return Lease(int(row["job_id"]), str(row["owner"]), float(row["expires"]), int(row["epoch"]))
