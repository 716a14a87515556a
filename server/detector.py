"""The failure detector: a task on the event loop sweeping every job's heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time

from checkflow_server.service import Coordinator

logger = logging.getLogger(__name__)


async def run_detector(
    coordinator: Coordinator, *, period_s: float, retune_period_s: float
) -> None:
    """Forever: declare silent ranks failed every ``period_s``; retune intervals now and then.

    Runs on the event loop (not a thread) so that it sees and writes the same state as the
    handlers without locks; a sweep costs one ``min()`` per job unless something is late.
    """
    # A service that just started has no reports to tune from: the first retune comes one
    # period in, like every later one.
    next_retune = time.monotonic() + retune_period_s
    while True:
        await asyncio.sleep(period_s)
        try:
            coordinator.detect()
            now = time.monotonic()
            if now >= next_retune:
                next_retune = now + retune_period_s
                coordinator.retune()
        except Exception:
            # A failed sweep (e.g. a full disk) must not stop detection for good.
            logger.exception("failure detector sweep failed; retrying")
