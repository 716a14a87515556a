"""The lease loop of a replica: renew its leases, take over the jobs whose lease ran out.

On the event loop, like the detector: it changes ``Coordinator.jobs`` without locks. A
database that cannot be reached fails a round, logged once until it is back: the jobs held
stay in memory meanwhile (heartbeats are answered; writes get 503), and whatever this
replica lost while cut off is dropped at the first renewal that gets through.
"""

from __future__ import annotations

import asyncio
import logging
import time

from checkflow_server.domain import ownership
from checkflow_server.service import Coordinator

logger = logging.getLogger(__name__)


async def run_leases(coordinator: Coordinator) -> None:
    """Forever: renew every ``RENEW_S``, look for expired leases every ``TAKEOVER_S``."""
    next_renew = time.monotonic() + ownership.RENEW_S
    failing = False
    while True:
        await asyncio.sleep(ownership.TAKEOVER_S)
        try:
            if time.monotonic() >= next_renew:
                next_renew = time.monotonic() + ownership.RENEW_S
                coordinator.renew()
            coordinator.take_over()
            if failing:
                logger.warning("job leases: the database answers again")
            failing = False
        except Exception as e:
            if not failing:
                why = str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__]
                logger.warning(
                    "job leases: %s; retrying every %.0f s", why[0], ownership.TAKEOVER_S
                )
            failing = True
