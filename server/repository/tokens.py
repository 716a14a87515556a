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

from checkflow_server.repository.database import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS job_tokens (
    digest TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    created REAL NOT NULL
);
"""
PREFIX = "cfj_"
"""Every job token starts with this: a log or a secret scanner can tell one at a glance."""


def digest(token: str) -> str:
    """The stored form of ``token``: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


class JobTokens:
    """The job tokens of a coordinator, written through to ``db``."""

    def __init__(self, db: Database) -> None:
        self.db = db
        db.conn.executescript(SCHEMA)
        self._jobs = {r["digest"]: r["job"] for r in db.conn.execute("SELECT * FROM job_tokens")}
        """digest -> job name."""

    def issue(self, job: str) -> str:
        """A new token for ``job``: stored as its digest, returned in clear this once."""
        token = PREFIX + secrets.token_urlsafe(32)
        key = digest(token)
        with self.db.transaction() as conn:
            conn.execute("INSERT INTO job_tokens VALUES (?, ?, ?)", (key, job, time.time()))
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
        return self._jobs.get(digest(token))
