"""The heartbeat flush: a task on the event loop writing the batched heartbeat fields."""

from __future__ import annotations

import asyncio
import logging

from checkflow_server.repository import Repository

logger = logging.getLogger(__name__)


async def run_heartbeat_flush(repository: Repository, period_s: float) -> None:
    """Forever: every ``period_s``, write the heartbeats held since the last flush in one
    commit (see ``Repository.save`` for what a SIGKILL can lose, and why it is harmless).

    On the event loop, like the handlers: the held rows are read and cleared without locks.
    """
    while True:
        await asyncio.sleep(period_s)
        try:
            repository.flush_heartbeats()
        except Exception:
            # The rows stay held and go with the next write: a full disk must not stop this.
            logger.exception("heartbeat flush failed; retrying")
