"""Which replica serves a job: the rules of job leases, apart from SQL and clocks.

Several ``checkflow serve`` replicas on one PostgreSQL database each serve some jobs. A
job is served by the replica holding its lease: a row (owner, expiry, epoch) it renews
every :data:`RENEW_S` for :data:`TTL_S`. The owner keeps the job in memory (heartbeats
included: the database sees them only in batches) and every write it makes is fenced by
the epoch it took the lease under. Any other replica redirects the job's requests to the
owner's advertised URL (307, so a POST keeps its body). When the owner stops renewing
(killed, its host gone, cut off from the database), the lease expires and the first
replica to see it takes the job: epoch + 1, the job loaded from the database, every alive
rank given a fresh grace period, as after a restart. A replica whose advertised URL is the
owner's is that owner restarted: it takes its jobs back at once, without waiting out the
lease (no other process answers that URL).

Failover therefore takes at most ``TTL_S`` + :data:`TAKEOVER_S` + a load, about 11 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from urllib.parse import quote

TTL_S = 10.0
"""How long a lease lasts from its last renewal (on the database's clock)."""
RENEW_S = 3.0
"""How often the owner renews: three tries fit in a lease before it can expire."""
TAKEOVER_S = 1.0
"""How often each replica looks for expired leases to take."""


@dataclass(frozen=True)
class Lease:
    """A job's lease row: who serves the job (an advertised URL), until when, which epoch."""

    job_id: int
    owner: str
    expires: float
    epoch: int


class Route(Enum):
    """What a replica does with a request for a job it does not hold in memory."""

    TAKE = "take"
    """Claim the lease (epoch + 1), load the job, serve it."""
    REDIRECT = "redirect"
    """Answer 307 to the owner's URL."""


def route(lease: Lease | None, me: str, now: float) -> Route:
    """A job's request reaching replica ``me`` (its advertised URL) that does not hold it.

    No lease row (a job written before leases, or by a single-process coordinator), a lease
    of ``me`` (this replica restarted: nobody else answers its URL) or an expired one:
    take it. Else the owner is alive by its last renewal: redirect there.
    """
    if lease is None or lease.owner == me or expired(lease, now):
        return Route.TAKE
    return Route.REDIRECT


def expired(lease: Lease, now: float) -> bool:
    """Whether ``lease`` ran out: its owner did not renew it in time."""
    return lease.expires <= now


def holds(lease: Lease | None, me: str, epoch: int | None) -> bool:
    """Whether replica ``me``, which took the job under ``epoch``, still holds it: the
    fence every write of the job passes. An expired lease nobody took yet still holds (no
    one else can have written since); a new epoch or another owner does not."""
    return lease is not None and epoch is not None and lease.owner == me and lease.epoch == epoch


def next_epoch(lease: Lease | None) -> int:
    """The epoch a take-over claims: one past the lease's, 1 for a job without one."""
    return 1 if lease is None else lease.epoch + 1


def lost(held: dict[int, int], renewed: dict[int, int]) -> set[int]:
    """The jobs of ``held`` (job -> epoch taken) whose renewal did not come back under the
    same epoch (``renewed``: job -> epoch of the rows still ours): another replica has them."""
    return {job for job, epoch in held.items() if renewed.get(job) != epoch}


def location(owner: str, path: str, query: str) -> str:
    """Where a 307 sends a request: the owner's URL with the same path and query."""
    target = owner.rstrip("/") + quote(path, safe="/%:@!$&'()*+,;=-._~")
    return f"{target}?{query}" if query else target
