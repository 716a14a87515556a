"""The coordinator's client side: one :class:`CoordinatorClient` per rank.

- :mod:`checkflow.client.rank`: registration, the heartbeat thread (the in-rank watchdog
  that exits a rank told to abort), persist and commit reports.
- :mod:`checkflow.client.transport`: HTTP in protocol models (:mod:`checkflow.protocol`),
  over the URL list of :mod:`checkflow.client.endpoints` (failover, 307s).
"""

from __future__ import annotations

from checkflow.client.backoff import MAX_BACKOFF_S
from checkflow.client.rank import ABORT_EXIT_CODE, CoordinatorClient
from checkflow.client.transport import CoordinatorUnavailable
from checkflow.protocol import Registration, Schedule

CheckpointSchedule = Schedule
"""The job's checkpoint schedule (the protocol's :class:`~checkflow.protocol.Schedule`)."""

__all__ = [
    "ABORT_EXIT_CODE",
    "MAX_BACKOFF_S",
    "CheckpointSchedule",
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "Registration",
]
