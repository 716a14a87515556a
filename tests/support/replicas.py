"""Several real ``checkflow serve`` replicas on one PostgreSQL database, for the tests.

Each replica is a :class:`~tests.support.coordinator.ServerProcess` on a port of its own
with the same token and ``--db`` URL (its advertised URL is ``http://127.0.0.1:PORT``, the
default). Use::

    with replicas(cluster.new_database(), 2) as (a, b):
        a.create_job(...)          # a serves it
        b.http().get(...)          # 307 to a

:func:`start_together` starts them all at once (for the migration-lock test).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.support.coordinator import SERVE, TOKEN, ServerProcess


def replica(db_url: str, *options: str, **env: str) -> ServerProcess:
    """One replica of the database at ``db_url`` (not started)."""
    return ServerProcess(db_url, options=options, **env)


@contextmanager
def replicas(db_url: str, count: int, *options: str, **env: str) -> Iterator[list[ServerProcess]]:
    """``count`` replicas started one after the other, stopped after the block."""
    started = [replica(db_url, *options, **env) for _ in range(count)]
    try:
        for r in started:
            r.start()
        yield started
    finally:
        for r in started:
            r.stop()


def start_together(servers: list[ServerProcess], timeout: float = 60) -> None:
    """Start every server's process at once, then wait until each answers ``/healthz``."""
    for s in servers:
        env = {**s.env, "CHECKFLOW_TOKEN": TOKEN}
        cmd = [sys.executable, "-c", SERVE, "serve", "--port", str(s.port), "--db", str(s.db),
               "--log-level", "warning", *s.options]  # fmt: skip
        s.proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + timeout
    for s in servers:
        while True:
            assert s.proc is not None and s.proc.poll() is None, "a replica exited at start"
            try:
                if httpx.get(f"{s.url}/healthz", timeout=0.5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "a replica did not start"
            time.sleep(0.05)
