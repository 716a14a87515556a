"""Learn committed checkpoints from storage: the steps under ``<uri>`` with a MANIFEST.json.

The coordinator is not the source of truth for commits, storage is: after losing its
database, or for checkpoints committed while it was down, this listing fills the gap.
The listing runs in a worker thread (it is network I/O), never on the event loop.

It also runs once per generation before the generation's first registration is answered:
a rank that died after writing a commit but before reporting it leaves a checkpoint the
coordinator thinks abandoned, and the restarted group would redo steps it had (a 50-cycle
stress run saw this 4 times). Registrations wait for that listing, up to
:data:`REGISTRATION_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import logging

from checkflow_server.service import Coordinator

from checkflow.manifest import MANIFEST, parse_step_dir

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 1.0
"""Longest a registration waits for its generation's storage listing; then it is answered
with the restore point known so far (the listing goes on and is learned when it ends).
Below the rank client's request timeout (2 s), so that a slow store never makes a
registration fail; a listing of local or S3 storage usually takes milliseconds."""


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
        self._per_generation: dict[str, tuple[int, asyncio.Task[None]]] = {}

    def schedule(self, name: str) -> None:
        """List job ``name``'s storage soon, in the background (on the running loop)."""
        if self.enabled:
            self.tasks.add(asyncio.create_task(self._sync(name)))

    async def before_registration(self, name: str) -> None:
        """Wait (at most :data:`REGISTRATION_WAIT_S`) for job ``name``'s storage to be
        listed in its current generation; the first registration of a generation starts
        the listing, the others wait for the same one. The event loop is never blocked."""
        job = self.coordinator.jobs.get(name)
        if not self.enabled or job is None or not job.storage_uri:
            return
        known = self._per_generation.get(name)
        if known is None or known[0] != job.generation:
            task = asyncio.create_task(self._sync(name))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            known = self._per_generation[name] = (job.generation, task)
        try:
            await asyncio.wait_for(asyncio.shield(known[1]), REGISTRATION_WAIT_S)
        except TimeoutError:
            logger.warning(
                "job %s: storage listing takes over %.1f s; registrations of generation %d are "
                "answered with the restore point known so far",
                name,
                REGISTRATION_WAIT_S,
                known[0],
            )
        except Exception:  # the listing's own failure is logged there; serve without it
            return

    async def _sync(self, name: str) -> None:
        job = self.coordinator.jobs.get(name)
        if job is None or not job.storage_uri:
            return
        steps = await asyncio.to_thread(committed_steps, job.storage_uri)
        added = self.coordinator.learn_commits(name, steps)  # back on the loop: SQLite here
        if added:
            logger.info("job %s: %d committed checkpoints found on storage", name, added)
