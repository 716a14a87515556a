"""Learn committed checkpoints from storage: the steps under ``<uri>`` with a MANIFEST.json.

The coordinator is not the source of truth for commits, storage is: after losing its
database, or for checkpoints committed while it was down, this listing fills the gap.
The listing runs in a worker thread (it is network I/O), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging

from checkflow_server.service import Coordinator

from checkflow.manifest import MANIFEST, parse_step_dir

logger = logging.getLogger(__name__)


def committed_steps(uri: str) -> list[int]:
    """Steps under ``uri`` whose ``MANIFEST.json`` exists; [] when storage can't be listed."""
    import fsspec  # imported here: only needed when a job names its storage

    try:
        fs, root = fsspec.core.url_to_fs(uri)
        found = fs.glob(f"{root.rstrip('/')}/step-*/{MANIFEST}")
    except Exception as e:  # any backend error: the coordinator must keep serving
        logger.warning("cannot list checkpoints under %s: %s", uri, e)
        return []
    steps = (parse_step_dir(p.rsplit("/", 2)[-2]) for p in found)
    return sorted(s for s in steps if s is not None)


class StorageSync:
    """Background listings of jobs' storage, one task per job asked for.

    Args:
        coordinator: Told of the commits found.
        tasks: Where the tasks are kept (the app cancels them at shutdown).
        enabled: False: :meth:`schedule` does nothing (``sync_storage=False``).
    """

    def __init__(
        self, coordinator: Coordinator, tasks: set[asyncio.Task[None]], enabled: bool
    ) -> None:
        self.coordinator = coordinator
        self.tasks = tasks
        self.enabled = enabled

    def schedule(self, name: str) -> None:
        """List job ``name``'s storage soon, in the background (on the running loop)."""
        if self.enabled:
            self.tasks.add(asyncio.create_task(self._sync(name)))

    async def _sync(self, name: str) -> None:
        job = self.coordinator.jobs.get(name)
        if job is None or not job.storage_uri:
            return
        steps = await asyncio.to_thread(committed_steps, job.storage_uri)
        added = self.coordinator.learn_commits(name, steps)  # back on the loop: SQLite here
        if added:
            logger.info("job %s: %d committed checkpoints found on storage", name, added)
