"""The public ``Checkpointer``: wires policy, snapshot, persist and the coordinator client.

It does no I/O and no encoding: on the training thread it counts steps, asks the policy
whether a checkpoint is due and starts a snapshot; the slow work runs on other threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from checkflow import resume
from checkflow.codec import CodecRules
from checkflow.config import CheckpointConfig, from_arguments, with_launcher_settings
from checkflow.determinism import environment, warn_if_different
from checkflow.interval import FrequencyTuner
from checkflow.memory.jit import check_replicated
from checkflow.memory.jit_hooks import CheckpointerJit, NoJit
from checkflow.memory.tier import RamTier, TieredWrite, ram_tier, write_plan
from checkflow.parallel import adapters, agreement, groups, sharding
from checkflow.state import FlatState, check_state, flatten, load_into
from checkflow.storage import Storage
from checkflow.storage.probe import check_writable
from checkflow.write.backpressure import acquire_buffer_set, count_skip, done_future, wait_for_all
from checkflow.write.buffers import HostBufferPool
from checkflow.write.commit import RankResult, commit_protocol
from checkflow.write.decisions import SavePolicy, save_policy
from checkflow.write.measure import CostMeter
from checkflow.write.persist import PersistWorker
from checkflow.write.snapshot import Snapshot, Snapshotter, protected_pointers
from checkflow.write.stats import CheckpointStats

log = logging.getLogger(__name__)

META_KEY = "__checkflow__"
"""Skeleton entry holding checkflow's own state (the step counter)."""


class Checkpointer:
    """Frequent, asynchronous, exact checkpoints of a training job.

    Args:
        uri: a local path or fsspec URL (``file://``, ``memory://``, ``s3://``, ``gs://``…).
        state: name -> object with ``state_dict()``/``load_state_dict()`` (modules,
            optimizers, LR schedulers, stateful data loaders).
        process_group: the job's process group (default: ``torch.distributed``'s, if any).
        config: every other option at once, as a ``CheckpointConfig``; or pass them as
            keyword arguments, one by one (not both):
        every: checkpoint every N steps, or ``"auto"``: the smallest interval whose measured
            overhead stays under ``max_overhead`` and that lets each persist finish in time.
        max_overhead: fraction of training time checkpoints may take (``every="auto"``).
        codec: a codec name for every tensor, or ``{glob on fqn: name}`` (first match wins).
        keep: committed checkpoints to retain (0 keeps all).
        rng: also save and restore the torch, CUDA, numpy and Python RNG states.
        coordinator: URL of a checkflow coordinator; ``job`` names the job there.
        full_every: with incremental codecs, a full checkpoint at least every N deltas.
        when_busy: what a due checkpoint does while both host buffer sets are persisting:
            ``"wait"`` (the default; counted in ``stats.waits``) or ``"skip"``.
        storage_options: passed to fsspec (credentials, endpoint).
        token: bearer token for the coordinator.
        hang_timeout: seconds a still step may last before the coordinator calls it a hang.
        allow_pickle: store state values that are not data as pickles (loading needs
            ``trust=True``).
        ram_dir, ram_keep, ram_every: the RAM tier, read first on a restart (see ``config``).
        jit: declares the ranks data-parallel replicas; a failure then leaves a just-in-time
            checkpoint of the current step in the RAM tier (``checkflow.memory.jit``).

    Raises:
        ValueError / TypeError: a bad argument, before anything is written.
    """

    def __init__(
        self,
        uri: str,
        state: Mapping[str, Any],
        *,
        every: int | str = "auto",
        max_overhead: float = 0.035,
        codec: str | Mapping[str, str] = "exact",
        keep: int = 3,
        rng: bool = True,
        coordinator: str | None = None,
        job: str | None = None,
        process_group: Any = None,
        full_every: int = 10,
        when_busy: str = "wait",
        storage_options: dict[str, Any] | None = None,
        token: str | None = None,
        hang_timeout: float | None = None,
        allow_pickle: bool = False,
        ram_dir: str | None = None,
        ram_keep: int = 2,
        ram_every: int | None = None,
        jit: bool = False,
        config: CheckpointConfig | None = None,
    ) -> None:
        self.config = with_launcher_settings(from_arguments(locals(), config))
        cfg = self.config
        check_state(state)
        self.state = dict(state)
        self.codecs = CodecRules(cfg.codec)
        self.storage = Storage(uri, storage_options=cfg.storage_options)
        self.group, self.rank, self.world_size = groups.checkpoint_group(process_group)
        self.stats = CheckpointStats(interval=None if cfg.auto else int(cfg.every))
        self._tuner = FrequencyTuner(max_overhead=cfg.max_overhead) if cfg.auto else None
        self._optimizers = [o for o in self.state.values() if isinstance(o, torch.optim.Optimizer)]
        self._step = self._last_checkpoint_step = 0
        self._last_step_end: float | None = None
        self._opened = False
        self._client: Any = None
        self._registration: Any = None
        self._snapshotter: Snapshotter | None = None
        self._persist: PersistWorker | None = None
        self._ram: RamTier | None = None
        self.restored_from = ""  # the tier the last restore() read: "ram", "storage" or ""
        self._hooks: list[Any] = []
        self._current: Snapshot | None = None
        self._pending: list[Future[int]] = []
        self._last_future: Future[int] | None = None
        self._meter = CostMeter(self._tuner)
        self._policy: SavePolicy | None = None
        self._sync: agreement.RankSync | None = None
        self._global_names = sharding.global_state_names(self.state)
        self._jit: CheckpointerJit | NoJit = NoJit()
        if cfg.jit:
            check_replicated(self.state, len(self._optimizers))

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        self.open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._jit.training_failed(exc_type, exc)
        if exc_type is not None and self._client is not None:
            self._client.exit_if_aborted()  # a peer's abort may be why training failed
        self.close(raise_errors=exc_type is None)

    def open(self) -> None:
        """Check that the root takes a write, then start the background threads and hooks
        (``with`` does this). Raises ``StorageError`` at once when the root is not writable."""
        if self._opened:
            return
        check_writable(self.storage)  # before any thread: not a failure per checkpoint
        self._opened = True
        self._snapshotter = Snapshotter(buffer_sets=2)
        if self.world_size > 1:
            self._sync = agreement.RankSync(self.group, self.storage.uri)
        if self.config.coordinator:
            self._connect()  # before the persist worker: its commit protocol needs the client
        sync = self._sync
        self._policy = save_policy(self.config.every, self._tuner, self._sync, self._client)
        self._persist = PersistWorker(
            self.storage,
            rank=self.rank,
            world_size=self.world_size,
            codecs=self.codecs,
            commit=commit_protocol(sync.commit if sync is not None else None, self._client),
            keep=self.config.keep,
            full_every=self.config.full_every,
            on_persisted=self._on_persisted,
            on_done=self._snapshotter.release,
            allow_pickle=self.config.allow_pickle,
            stats=self.stats,
        )
        self._ram = ram_tier(self.config, self.group, self._snapshotter, self._client)
        if self.config.jit:
            parts = (self.state, self._global_names, self._ram, self.config, META_KEY)
            self._jit = CheckpointerJit(*parts, client=self._client)
            self._hooks.append(self._jit.uncaught_error_hook())
        for opt in self._optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._before_optimizer_step))

    def close(self, *, raise_errors: bool = True) -> None:
        """Wait for in-flight checkpoints, then stop threads and remove hooks."""
        if not self._opened:
            return
        try:
            self.wait() if raise_errors else self._wait_quietly()
        finally:
            self._opened = False
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            assert self._persist is not None and self._snapshotter is not None
            if self._ram is not None:  # first: it hands its snapshots on to storage
                self._ram.close()
            self._persist.close()
            self._snapshotter.close()
            if self._client is not None:
                if raise_errors:  # a normal exit: its silence from now on is no failure
                    self._client.finish()
                self._client.close()

    def _connect(self) -> None:
        from checkflow.connect import coordinator_client  # httpx only when a coordinator is set

        self._client = coordinator_client(self.config, self.rank, self.world_size, self.storage.uri)
        self._registration = self._client.register()
        self._client.start()

    def paused(self) -> AbstractContextManager[None]:
        """``with ckpt.paused():`` around a known long pause (eval, an export): the still step
        is no hang. Nestable; blocking ``save()``, ``wait()``, ``restore()`` pause on their own."""
        return self._client.paused() if self._client is not None else nullcontext()

    # -- restore ---------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, trust: bool = False) -> int:
        """Load the newest committed checkpoint (or ``step``) into the state objects.

        A checkpoint that fails verification is skipped (a warning) for the next older one;
        the coordinator's restore point is the default, and one storage lacks is reported
        back. Every rank must call this: they agree in the job's store on one step all read.

        Args:
            step: the checkpoint to load (default: the newest, or the coordinator's).
            trust: unpickle objects stored as pickles (``allow_pickle=True``, or an old
                checkpoint); it runs code from the checkpoint: only for writers you trust.

        Returns:
            The number of completed steps of the restored checkpoint; 0 when there is none.

        Raises:
            UntrustedCheckpointError: an object is a pickle and ``trust`` is False.
        """
        self.open()
        self._wait_quietly()  # a step in flight would commit past the restored one
        point = self._registration.restore_step if self._registration is not None else None
        advised = step is None and self._registration is not None
        step = point if advised else step
        with self.paused():  # reading may take long: not a hang
            found, self.restored_from = resume.read_tiered(
                self.storage, self.state, step, self._sync, self._ram, rank=self.rank,
                trust=trust, advised=advised, persist=self._persist,
            )  # fmt: skip
        if self._client is not None:  # below its restore point: it abandons the steps above
            self._client.report_restored(point, found[0] if found is not None else None)
        if found is None:
            return 0
        meta = found[1].pop(META_KEY, {})
        load_into(self.state, found[1])
        self._step = int(meta.get("step", found[0]))
        if self.codecs.lossless:
            warn_if_different(meta.get("environment", {}), step=self._step, uri=self.storage.uri)
        self._last_checkpoint_step, self._last_step_end = self._step, None
        self._last_future = done_future(found[0]) if self.restored_from == "storage" else None
        self._jit.mark(self._step)
        log.info("restored step %d from %s (%s)", self._step, self.storage.uri, self.restored_from)
        return self._step

    # -- the training loop -----------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """Completed steps so far (restored + counted by ``step()``)."""
        return self._step

    def step(self) -> Future[int] | None:
        """Count one completed training step; start a checkpoint if one is due.

        Returns:
            The checkpoint's future (resolves to its step when committed), or None.
        """
        self.open()  # once: a no-op when open
        now = time.perf_counter()
        self._observe(now)
        self._step += 1
        self._jit.mark(self._step)
        assert self._policy is not None
        due = self._policy.is_due(self._step, self._last_checkpoint_step)
        self.stats.interval = self._policy.interval
        ram_due = self._ram is not None and self._ram.is_due(self._step)
        future = self._checkpoint(force=False, storage=due) if due or ram_due else None
        self._last_step_end = time.perf_counter()
        return future

    def save(self) -> Future[int]:
        """Checkpoint the current step now; returns its future.

        Waits for a free host buffer set when two persists are in flight. Calling it at a
        step that was already checkpointed returns that checkpoint's future.
        """
        self.open()  # once: a no-op when open
        if self._last_future is not None and self._last_checkpoint_step == self._step:
            return self._last_future
        future = self._checkpoint(force=True)
        assert future is not None
        return future

    def wait(self) -> None:
        """Block until every checkpoint in flight is committed and the steps beyond
        ``keep`` deleted (a ``save()`` future resolves at the commit, before that).

        Raises:
            Exception: the first error of a failed persist."""
        with self.paused():  # a blocking wait: not a hang
            pending, self._pending = self._pending, []
            wait_for_all(pending)
            if self._persist is not None:
                self._persist.settle()

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception as e:  # the training error that is unwinding matters more
            log.error("a checkpoint failed while exiting: %s", e)

    def _checkpoint(self, *, force: bool, storage: bool = True) -> Future[int] | None:
        assert self._persist is not None and self._snapshotter is not None
        self.stats.due += storage  # False: a RAM-only step (ram_every), not a due checkpoint
        t0 = time.perf_counter()
        skip = self.config.when_busy == "skip" and not force
        pool = None if skip else self._acquire()
        # With several ranks, prepare_snapshot tells every rank whether one has no free buffer
        # set (only with when_busy="skip"): they skip together, or a part would be missing.
        busy = skip and not self._snapshotter.buffers.has_free()
        if busy and self._sync is None:
            count_skip(self.stats, self._step, "the previous persists are still running")
            return None
        flat = flatten(self.state, rng=self.config.rng, allow_pickle=self.config.allow_pickle)
        # How this process computes: a resume in another setting warns that it cannot be exact.
        flat.skeleton[META_KEY] = {"step": self._step, "environment": environment()}
        before = dict(flat.tensors)  # all this rank holds: the RAM tier keeps every tensor
        shards = adapters.prepare_snapshot(
            flat, self._global_names, self._sync, busy=busy,
            interval=self._policy.proposed if self._policy is not None else None,
            rank=self.rank,
        )
        if shards is None:
            count_skip(self.stats, self._step, "a rank is still persisting")
            return None
        if pool is None:
            pool = self._acquire()
        plan = write_plan(self._ram, before, flat, shards, self._global_names, storage=storage)
        return self._take(flat, plan, pool, t0)

    def _acquire(self) -> HostBufferPool:
        """A free host buffer set; waiting for a persist (a slow store?) is a pause, not a hang."""
        assert self._snapshotter is not None
        with nullcontext() if self._snapshotter.buffers.has_free() else self.paused():
            return acquire_buffer_set(self._snapshotter.buffers, self.stats, self._step)

    def _take(
        self, flat: FlatState, plan: TieredWrite, pool: HostBufferPool, t0: float
    ) -> Future[int]:
        """Start the snapshot into ``pool`` and queue its persist; count the stall."""
        assert self._persist is not None and self._snapshotter is not None
        protected = protected_pointers(self._optimizers)
        protected |= adapters.local_pointers(self._optimizers)
        self._persist.decide_timeline() if plan.storage else None  # here, as every agreement
        snap = self._snapshotter.take(self._step, flat, protected, pool)
        self._current = snap
        future = plan.submit(snap, self._persist)
        self._pending = [f for f in self._pending if not f.done()] + [future]
        if not plan.storage:
            return future
        self._last_future = future
        self._last_checkpoint_step = self._step
        self.stats.taken += 1
        stall = time.perf_counter() - t0
        self.stats.stalls_s.append(stall)
        self._meter.checkpoint_started(self._step, stall, future)
        return future

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._jit.before_update()
        snap = self._current
        if snap is None:
            return
        waited = snap.block_optimizer()
        self._current = None
        if waited and self.stats.stalls_s:
            self.stats.stalls_s[-1] += waited
            self._meter.optimizer_waited(snap.step, waited)

    def _observe(self, now: float) -> None:
        """Feed the policy: step times, and each checkpoint's cost once it committed."""
        if self._last_step_end is None:
            return
        dt = now - self._last_step_end
        meter = self._meter
        if self._client is not None:
            self._client.report_progress(self._step, *meter.reported(dt))
        if meter.step_ended(dt):
            meter.retune(log, self._step)

    def _on_persisted(self, result: RankResult) -> None:
        # Runs on the persist thread, which has counted the result in self.stats.
        last_stall = self.stats.stalls_s[-1] if self.stats.stalls_s else None
        self._meter.persisted(result.step, result.duration_s, last_stall)
        if self._client is not None and result.committed:
            self._client.report_committed(result.step)
