"""Per-job tokens: issued once, kept only as their SHA-256, looked up in memory.

A job token lets its holder act on one job only (the rules are in ``api/auth.py``). It is
32 random bytes, so a plain SHA-256 of it cannot be reversed or guessed: a copy of the
database gives no usable token. The digests live in their own table, loaded into a dict at
startup, so checking a token on every heartbeat costs one hash and one dict lookup, never
a query. A job may hold several tokens (one per launcher that asked for one).
"""

from __future__ import annotations

import hashlib
import secrets
import time

import sqlalchemy as sa
from checkflow_server.repository.database import Database
from checkflow_server.repository.schema import job_tokens

PREFIX = "cfj_"
"""Every job token starts with this: a log or a secret scanner can tell one at a glance."""


def digest(token: str) -> str:
    """The stored form of ``token``: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


class JobTokens:
    """The job tokens of a coordinator, written through to ``db``."""

    def __init__(self, db: Database, *, shared: bool = False) -> None:
        """``shared``: other replicas issue tokens into the same database, so a digest not
        known here is looked up there once (and remembered when found)."""
        self.db = db
        self.shared = shared
        with db.transaction() as conn:
            found = conn.execute(sa.select(job_tokens.c.digest, job_tokens.c.job))
            self._jobs = {str(r.digest): str(r.job) for r in found}
        """digest -> job name."""

    def issue(self, job: str) -> str:
        """A new token for ``job``: stored as its digest, returned in clear this once."""
        token = PREFIX + secrets.token_urlsafe(32)
        key = digest(token)
        with self.db.transaction() as conn:
            conn.execute(job_tokens.insert().values(digest=key, job=job, created=time.time()))
        self._jobs[key] = job
        return token

    def job_of(self, token: str) -> str | None:
        """The job ``token`` was issued for; None: not a job token.

        The lookup is by the digest, never by the token: a guess's digest is unrelated to
        any stored one, so how long the lookup takes tells nothing about a real token (the
        role a constant-time compare plays for the admin token).
        """
        if not token.startswith(PREFIX):
            return None
        key = digest(token)
        job = self._jobs.get(key)
        if job is None and self.shared:
            job = self._issued_elsewhere(key)
        return job

    def _issued_elsewhere(self, key: str) -> str | None:
        """The job of a digest another replica issued; None: no such token (or the
        database is unreachable, which then refuses the request as a wrong token would)."""
        try:
            with self.db.transaction() as conn:
                query = sa.select(job_tokens.c.job).where(job_tokens.c.digest == key)
                found = conn.execute(query).scalar()
        except sa.exc.SQLAlchemyError:
            return None
        if found is not None:
            self._jobs[key] = str(found)
        return None if found is None else str(found)
