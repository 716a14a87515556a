"""A ``Checkpointer``'s coordinator client, made from its options.

Kept out of the ``Checkpointer`` so that it reads as the wiring of its parts; the client
package itself knows nothing of ``CheckpointConfig`` (they are independent layers).
"""

from __future__ import annotations

from checkflow.client import CoordinatorClient
from checkflow.config import CheckpointConfig


def coordinator_client(
    cfg: CheckpointConfig, rank: int, world_size: int, storage_uri: str
) -> CoordinatorClient:
    """The client of ``cfg.coordinator`` for ``cfg.job``, not yet registered or started."""
    assert cfg.coordinator is not None and cfg.job is not None
    return CoordinatorClient(
        cfg.coordinator,
        cfg.job,
        rank,
        world_size,
        token=cfg.token,
        storage_uri=storage_uri,
        max_overhead=cfg.max_overhead,
        hang_timeout_s=cfg.hang_timeout,
        every=None if cfg.auto else int(cfg.every),
    )
