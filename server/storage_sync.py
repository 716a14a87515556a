"""Learn committed checkpoints from storage: the steps under ``<uri>`` with a MANIFEST.json.

The coordinator is not the source of truth for commits, storage is: after losing its
database, or for checkpoints committed while it was down, this listing fills the gap.
The listing runs in a worker thread (it is network I/O), never on the event loop.

It also runs once per generation before the generation's first registration is answered:
a rank that died after writing a commit but before reporting it leaves a checkpoint the
coordinator thinks abandoned, and the restarted group would redo steps it had (a 50-cycle
stress run saw this 4 times). Registrations wait for that listing, up to
:data:`REGISTRATION_WAIT_S`.

A job's ``storage_uri`` comes from a client: the coordinator reads only storage the
operator allowed (``--storage-allow``, :func:`storage_allowed`), so that no client makes it
fetch an internal address (SSRF). By default none is allowed and nothing here runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from checkflow_server.service import Coordinator

from checkflow import timeline as tl
from checkflow.manifest import MANIFEST, parse_step_dir

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 1.0
"""Longest a registration waits for its generation's storage listing; then it is answered
with the restore point known so far (the listing goes on and is learned when it ends).
Below the rank client's request timeout (2 s), so that a slow store never makes a
registration fail; a listing of local or S3 storage usually takes milliseconds."""


def storage_allowed(uri: str, allow: Sequence[str]) -> bool:
    """Whether the operator's rules ``allow`` (``SCHEME`` or ``SCHEME://HOST[:PORT]``,
    lower case) let the coordinator read ``uri``. A path without a scheme is ``file``.
    Refused whatever the rules: chained URLs (``a::b``, which fetch through another
    protocol), user info in the host (``s3://x@evil``), anything unparsable."""
    if "::" in uri:
        return False
    try:
        parts = urlsplit(uri)
        host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    except ValueError:
        return False
    if "@" in parts.netloc:
        return False
    scheme = parts.scheme.lower() or "file"
    if len(scheme) == 1:  # a Windows drive letter, not a scheme
        scheme = "file"
    return scheme in allow or f"{scheme}://{host}" in allow


def committed_steps(uri: str) -> list[int]:
    """Steps of the current lineage under ``uri`` (``checkflow.timeline``: not those of a
    rolled-back timeline) whose ``MANIFEST.json`` exists; [] when storage can't be listed."""
    import fsspec  # imported here: only needed when a job names its storage

    try:
        fs, root = fsspec.core.url_to_fs(uri)
        found = fs.glob(f"{root.rstrip('/')}/step-*/{MANIFEST}")
        lineage = _lineage(fs, fs.glob(f"{root.rstrip('/')}/{tl.TIMELINE_PREFIX}*.json"))
    except Exception as e:  # any backend error: the coordinator must keep serving
        logger.warning("cannot list checkpoints under %s: %s", uri, e)
        return []
    folders = (parse_step_dir(p.rsplit("/", 2)[-2]) for p in found)
    on, _ = lineage.pick(f for f in folders if f is not None)
    return sorted(on)


def _lineage(fs: Any, paths: list[str]) -> tl.Lineage:
    """The lineage the TIMELINE files at ``paths`` make; one that cannot be used is ignored."""
    records: dict[int, tl.Timeline] = {}
    ignored: dict[int, str] = {}
    for path in paths:
        k = tl.parse_timeline_file(path)
        if k is None:
            continue
        try:
            if fs.size(path) > tl.MAX_TIMELINE_BYTES:
                raise tl.TimelineError("it is over the size cap")
            records[k] = tl.parse_timeline(fs.cat_file(path), k)
        except (tl.TimelineError, OSError) as e:
            ignored[k] = str(e)
    return tl.resolve(records, ignored)


class StorageSync:
    """Background listings of jobs' storage, one task per job asked for.

    Args:
        coordinator: Told of the commits found.
        tasks: Where the tasks are kept (the app cancels them at shutdown).
        enabled: False: :meth:`schedule` does nothing (``sync_storage=False``).
        allow: the operator's storage rules (:func:`storage_allowed`); empty: none read.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        tasks: set[asyncio.Task[None]],
        enabled: bool,
        allow: Sequence[str] = (),
    ) -> None:
        self.coordinator = coordinator
        self.tasks = tasks
        self.enabled = enabled
        self.allow = tuple(allow)
        self._refused: set[str] = set()
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
        if not self.enabled or job is None or not self._readable(name, job.storage_uri):
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

    def _readable(self, name: str, uri: str | None) -> bool:
        """Whether job ``name``'s storage may be read here; a refusal is logged once."""
        if not uri:
            return False
        if storage_allowed(uri, self.allow):
            return True
        if name not in self._refused and self.allow:
            self._refused.add(name)
            logger.warning(
                "job %s: storage %s is not allowed by --storage-allow; the coordinator does "
                "not read it (the ranks do)",
                name,
                uri,
            )
        return False

    async def _sync(self, name: str) -> None:
        job = self.coordinator.jobs.get(name)
        if job is None or not self._readable(name, job.storage_uri):
            return
        assert job.storage_uri is not None
        steps = await asyncio.to_thread(committed_steps, job.storage_uri)
        added = self.coordinator.learn_commits(name, steps)  # back on the loop: SQLite here
        if added:
            logger.info("job %s: %d committed checkpoints found on storage", name, added)
