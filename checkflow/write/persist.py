"""Phase 2: encode, checksum and write a snapshot in the background, then commit.

One ``PersistWorker`` thread per rank takes snapshots in order. For each it encodes every
tensor chunk (≤ 64 MiB), writes the chunks into data files, writes the rank manifest, and
asks the ``CommitProtocol`` whether it is the rank that writes ``MANIFEST.json`` (the commit:
only once every rank's manifest is stored). The committing rank then applies retention,
after the checkpoint's future has resolved: deleting old steps is housekeeping (on a
virtual disk, unlinking 1 GiB of chunk files takes 0.5-0.7 s) and a caller waiting on
``save().result()`` waits for its checkpoint, not for that. It still runs on this thread
before the next snapshot is taken up, and ``settle()`` (``Checkpointer.wait()``) waits for
it, so ``wait()`` and ``close()`` return with old steps gone.
Nothing here ever runs on the training thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from checkflow import knobs, objects
from checkflow import manifest as mf
from checkflow.catalog import RetentionError, apply_retention
from checkflow.codec import CodecRules, get_codec
from checkflow.codec.base import dtype_name
from checkflow.lineage import current_lineage
from checkflow.storage import Storage, StorageAccessError
from checkflow.write.commit import CommitProtocol, RankResult, write_commit
from checkflow.write.datafiles import DataFileWriter, checksum, chunk_boxes
from checkflow.write.snapshot import Snapshot
from checkflow.write.stats import CheckpointStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PersistJob:
    snapshot: Snapshot
    future: Future[int]
    full: bool = False
    """Force a full (non-delta) checkpoint."""
    shards: dict[str, Any] | None = None
    """``{fqn: parallel.sharding.Shard}``: where a local tensor sits in its global tensor
    (absent: the tensor is whole)."""
    skip: frozenset[str] = frozenset()
    """Tensors of the snapshot not to write here (the RAM tier holds them; another rank
    writes them to storage)."""
    timeline: int | None = None
    """The timeline whose folder the step goes to (``checkflow.timeline``); None: the
    storage's current one."""


class PersistWorker:
    """Background thread that persists snapshots for one rank, in order.

    Args:
        storage: where checkpoints go.
        rank, world_size: this process's place in the job.
        codecs: which codec each tensor gets.
        commit: who writes the global manifest.
        keep: committed checkpoints to retain (0 keeps all); applied by the committing rank
            right after the commit's future has resolved.
        full_every: a full checkpoint at least every this many deltas.
        chain_budget: a full checkpoint whenever the deltas since the last full one add up
            to more than this fraction of it.
        on_persisted: called on this thread with each ``RankResult`` (reports, stats).
        on_done: called with the snapshot when its buffers may be reused.
        allow_pickle: store objects that are not data (``checkflow.objects``) as pickles
            instead of failing the checkpoint.
        stats: where this thread counts what it stored, committed or failed (the
            ``Checkpointer``'s own record; a new one by default).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        rank: int = 0,
        world_size: int = 1,
        codecs: CodecRules,
        commit: CommitProtocol,
        keep: int = 3,
        full_every: int = 10,
        chain_budget: float = 0.5,
        on_persisted: Callable[[RankResult], None] | None = None,
        on_done: Callable[[Snapshot], None] | None = None,
        meta: Callable[[], dict[str, Any]] | None = None,
        allow_pickle: bool = False,
        stats: CheckpointStats | None = None,
    ) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.codecs = codecs
        self.commit = commit
        self.keep = keep
        self.full_every = full_every
        self.chain_budget = chain_budget
        self.on_persisted = on_persisted
        self.on_done = on_done
        self.meta = meta
        self.allow_pickle = allow_pickle
        self.stats = stats if stats is not None else CheckpointStats()
        self._queue: queue.Queue[PersistJob | None] = queue.Queue()
        self._decide_timeline: Callable[[], int] | None = None
        self._storage_timeline: int | None = None  # where steps go; known at the first persist
        self._refs: dict[tuple[str, int], Any] = {}
        self._ref_step: int | None = None
        self._ref_timeline = 0
        self._deltas_since_full = 0
        self._full_bytes = 0
        self._chain_bytes = 0
        self._retention = threading.Condition()
        self._retentions_due = 0
        """Commits resolved whose retention has not run yet (counted before the future
        resolves, so whoever saw the future done and calls ``settle`` waits for it)."""
        self._retention_told: tuple[int, bool] | None = None
        """(folders left, permanent) of the retention outcome the coordinator last heard."""
        self._thread = threading.Thread(target=self._run, name="checkflow-persist", daemon=True)
        self._thread.start()

    # -- training-thread side --------------------------------------------------------------
    def submit(
        self,
        snapshot: Snapshot,
        *,
        full: bool = False,
        shards: dict[str, Any] | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> Future[int]:
        """Queue ``snapshot``; the future resolves to its step once committed (or raises).

        ``shards`` places local tensors (DTensor shards) in their global tensors; the
        tensors named in ``skip`` are not written."""
        future: Future[int] = Future()
        self._queue.put(PersistJob(snapshot, future, full, shards, skip))
        return future

    def continue_after_restore(self, decide: Callable[[], int]) -> None:
        """The steps submitted from now on go to the timeline ``decide()`` returns at the next
        :meth:`decide_timeline` (``resume.continue_timeline``: a rollback forks one)."""
        self._decide_timeline, self._storage_timeline = decide, None

    def decide_timeline(self) -> None:
        """The pending decision, made now on the training thread, as the job's other store
        agreements are (on the persist thread its blocking read deadlocked with them)."""
        if self._decide_timeline is not None:
            decide, self._decide_timeline = self._decide_timeline, None
            self._storage_timeline = decide()

    def settle(self) -> None:
        """Wait for the retention of every commit whose future has resolved (the
        ``Checkpointer.wait()`` side: after it, old steps beyond ``keep`` are gone)."""
        with self._retention:
            self._retention.wait_for(lambda: self._retentions_due == 0)

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        _lower_priority(knobs.persist_nice())
        while True:
            job = self._queue.get()
            if job is None:
                return
            error: BaseException | None = None
            committed = False
            try:
                committed = self._persist(job)  # writes each tensor once it is copied
            except BaseException as e:  # a failed persist must not kill the worker
                self.stats.failed += 1
                self.stats.last_error = failure_text(e)
                self._reset_chain()
                log.error("checkpoint of step %d failed: %s", job.snapshot.step, failure_text(e))
                error = e
                # Its buffers go back only once nothing copies into them: a persist that
                # failed early (unstorable objects) did not wait for the copy.
                with suppress(BaseException):
                    job.snapshot.wait()
            retain = committed and self.keep > 0
            if retain:
                with self._retention:
                    self._retentions_due += 1
            # Buffers first, then the future: whoever waited on the future may reuse them.
            try:
                if self.on_done is not None:
                    self.on_done(job.snapshot)
            finally:
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result(job.snapshot.step)
                if retain:
                    self._retain(job.snapshot.step)

    def _retain(self, step: int) -> None:
        """Delete the committed steps beyond ``keep``; a failure is counted in ``stats`` and
        logged, never raised: the checkpoint that triggered it is already committed. The
        coordinator hears the first outcome and each change (failing, or working again)."""
        try:
            apply_retention(self.storage, self.keep)
            self.stats.retention_error = ""
            if self._retention_told != (0, False):
                self._retention_told = (0, False)
                self.commit.retention_done(step, 0, "", permanent=False)
        except Exception as e:
            failed = len(e.failures) if isinstance(e, RetentionError) else 1
            permanent = isinstance(e, RetentionError) and e.permanent
            why = "the store refuses it; retrying will not help" if permanent else "retried later"
            self.stats.retention_failures += 1
            self.stats.retention_error = f"{e} ({why})"
            log.warning("retention after step %d left old steps (%s): %s", step, why, e)
            if self._retention_told is None or self._retention_told[0] == 0:
                self._retention_told = (failed, permanent)
                self.commit.retention_done(step, failed, str(e), permanent=permanent)
        finally:
            with self._retention:
                self._retentions_due -= 1
                self._retention.notify_all()

    def _reset_chain(self) -> None:
        # After a failure the step this rank's refs point at may never commit: start over.
        self._refs.clear()
        self._ref_step = None
        self._deltas_since_full = 0

    def _timeline(self, job: PersistJob) -> int:
        if job.timeline is not None:
            return job.timeline
        if self._storage_timeline is None:  # once: no rollback happens without a restore
            decide, self._decide_timeline = self._decide_timeline, None
            self._storage_timeline = decide() if decide else current_lineage(self.storage).current
        return self._storage_timeline

    def _want_full(self, job: PersistJob) -> bool:
        if (timeline := self._timeline(job)) != self._ref_timeline:
            # A rollback: the reference may be a step of the abandoned timeline, which no
            # reader of the new one would find (or would find another step in its place).
            self._reset_chain()
            self._ref_timeline = timeline
        if job.full or self._ref_step is None or not self._refs:
            return True
        if self._deltas_since_full >= self.full_every:
            return True
        return self._full_bytes > 0 and self._chain_bytes > self.chain_budget * self._full_bytes

    def _advance_chain(
        self, step: int, refs: dict[tuple[str, int], Any], is_delta: bool, nbytes: int
    ) -> None:
        """``step`` is stored: the next deltas are against it (a full one resets the chain)."""
        self._refs = refs
        self._ref_step = step
        if is_delta:
            self._deltas_since_full += 1
            self._chain_bytes += nbytes
        else:
            self._deltas_since_full = 0
            self._full_bytes = nbytes
            self._chain_bytes = 0

    def _persist(self, job: PersistJob) -> bool:
        """Store this rank's part of ``job``; True when this rank wrote the commit."""
        snap = job.snapshot
        t0 = time.perf_counter()
        job.timeline = self._timeline(job)
        full = self._want_full(job)
        # Encoded first: state that cannot be stored fails the checkpoint before any write.
        stored = objects.encode(snap.skeleton, allow_pickle=self.allow_pickle)
        folder = mf.step_dir(snap.step, job.timeline)
        self._refuse_committed(snap.step, folder)
        writer = DataFileWriter(self.storage, folder, self.rank)
        new_refs: dict[tuple[str, int], Any] = {}
        chunks: list[mf.ChunkEntry] = []
        for fqn, tensor in snap.ready():
            if fqn in job.skip:
                continue
            # A DTensor's shard (the write plan), or one of an XLA tensor's SPMD shards.
            shard = (job.shards or {}).get(fqn) or snap.boxes.get(fqn)
            chunks.extend(self._encode_tensor(fqn, tensor, writer, full, new_refs, shard))
        entries = [writer.add_object("skeleton", stored)]
        writer.flush()
        rank_manifest = mf.RankManifest(
            step=snap.step,
            rank=self.rank,
            world_size=self.world_size,
            created=time.time(),
            chunks=chunks,
            objects=entries,
            nbytes=writer.total,
        )
        manifest_path = f"{folder}/{mf.rank_manifest_name(self.rank)}"
        self.storage.put(manifest_path, [rank_manifest.to_json()])
        is_delta = any(c.base_step is not None for c in chunks)
        self._advance_chain(snap.step, new_refs, is_delta, writer.total)
        result = RankResult(
            snap.step, self.rank, manifest_path, writer.total, time.perf_counter() - t0
        )
        result.kind = "delta" if is_delta else "full"
        if delay := knobs.commit_delay_s():
            time.sleep(delay)  # fault injection for tests: a window to kill us mid-persist
        if self.commit.rank_persisted(snap.step, result):
            result.committed = True
            meta = self.meta() if self.meta else {}
            write_commit(self.storage, snap.step, self.world_size, meta=meta, folder=folder)
        duration = time.perf_counter() - t0
        self.stats.committed += 1
        self.stats.last_error = ""
        self.stats.last_step = snap.step
        self.stats.bytes_written += writer.total
        self.stats.last_bytes = writer.total
        self.stats.last_persist_s = duration
        self.stats.last_kind = "delta" if is_delta else "full"
        self.stats.persist_times.append(duration)
        result.duration_s = duration
        if self.on_persisted is not None:
            self.on_persisted(result)
        return result.committed

    def _refuse_committed(self, step: int, folder: str) -> None:
        """A committed step folder is never written again (issue 30): a kill half-way would
        leave a step mixing two states that passes every checksum."""
        if self.storage.exists(f"{folder}/{mf.MANIFEST}"):
            raise FileExistsError(
                f"step {step} is committed in {self.storage.url(folder)} already; a "
                "committed step is never written again (restore() to go on from it)"
            )

    def _encode_tensor(
        self,
        fqn: str,
        tensor: torch.Tensor,
        writer: DataFileWriter,
        full: bool,
        new_refs: dict[tuple[str, int], Any],
        shard: Any = None,
    ) -> list[mf.ChunkEntry]:
        key = fqn  # the snapshot's name for this host tensor: the delta reference's key
        fqn = getattr(shard, "fqn", fqn)  # the stored name (an SPMD shard's is its tensor's)
        name = self.codecs.name_for(fqn, tensor)
        codec = get_codec(name)
        shape = tuple(tensor.shape)
        global_shape = list(shard.global_shape) if shard is not None else list(shape)
        origin = list(shard.offset) if shard is not None else [0] * len(shape)
        entries = []
        for start, stop in chunk_boxes(shape, tensor.element_size(), knobs.chunk_bytes()):
            box = tensor.reshape(1) if not shape else tensor[start:stop]
            ref = None if full or not codec.incremental else self._refs.get((key, start))
            encoded, new_ref = codec.encode(box, ref)
            if codec.incremental:
                new_refs[(key, start)] = new_ref
            file, offset = writer.add(encoded.data)
            entries.append(
                mf.ChunkEntry(
                    fqn=fqn,
                    dtype=dtype_name(tensor.dtype),
                    global_shape=global_shape,
                    offset=[origin[0] + start, *origin[1:]] if shape else [],
                    shape=list(box.shape) if shape else [],
                    codec=name,
                    params=encoded.params,
                    file=file,
                    byte_offset=offset,
                    nbytes=encoded.nbytes,
                    checksum=checksum(encoded.data),
                    base_step=self._ref_step if encoded.delta else None,
                )
            )
        return entries


def failure_text(error: BaseException) -> str:
    """Why a persist failed, as logged and kept in ``stats.last_error``: an I/O error is a
    ``storage error`` (the store refused or failed; waiting longer would not help), anything
    else (state that cannot be stored, a bug) is shown as it is."""
    if isinstance(error, OSError | StorageAccessError):
        return f"storage error: {error}"
    return f"{type(error).__name__}: {error}"


def _lower_priority(nice: int) -> None:
    """Let training threads win the CPU over encoding and writing (Linux: per thread)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as e:  # not allowed here: persist at normal priority
        log.debug("could not lower the persist thread's priority: %s", e)
