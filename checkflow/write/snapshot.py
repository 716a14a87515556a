"""Phase 1: copy the training state into host buffers that are allocated once and reused.

There are at most two buffer sets (``BufferSets``): while one is being persisted, the next
due snapshot goes into the other, so a checkpoint is never skipped because storage is
still busy. Only when both are in use does the training thread wait for one (the caller
counts that wait as a stall).

The training thread calls ``Snapshotter.take`` and returns at once. Tensors that only an
optimizer step changes (parameters and optimizer state, the *protected* ones) are copied in
the background: on a CPU thread, or on a side CUDA stream ordered by events. Everything else
(module buffers such as BatchNorm statistics, which the next forward pass changes in place)
is copied before ``take`` returns. The optimizer step pre-hook calls
``Snapshot.block_optimizer`` so weights never change under a copy.

XLA tensors (torch_xla) are frozen by one graph cut that also makes device copies of them,
then moved to the host in bulk on the copy thread (``_XlaCopy``, device calls in
``checkflow.xla``); no step can change or donate those copies, so the optimizer step does
not wait for them. An SPMD-sharded tensor becomes one host tensor per addressable shard,
placed in its global tensor by ``Snapshot.boxes``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from checkflow import xla
from checkflow.state import FlatState

log = logging.getLogger(__name__)


class HostBufferPool:
    """One host tensor per fqn, reused by every snapshot; pinned when the source is on CUDA."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0
        """How many buffers were allocated so far; constant in steady state."""

    def buffer_for(self, fqn: str, source: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(fqn)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            # Pinning needs a CUDA driver; a tensor that only claims to be on CUDA (the
            # stand-in of the unit tests) gets pageable memory.
            pin = source.is_cuda and torch.cuda.is_available()
            buf = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
            self._buffers[fqn] = buf
            self.allocations += 1
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class BufferSets:
    """At most ``limit`` host buffer sets, made on first need and then reused.

    A set is *acquired* for one snapshot on the training thread and *released* by the
    persist thread once that snapshot is written (its buffers may then be overwritten).
    With two sets, one snapshot can be copied while the previous one is still persisting;
    memory is one more copy of the state, allocated once.
    """

    def __init__(self, limit: int = 2) -> None:
        if limit < 1:
            raise ValueError(f"need at least one host buffer set, got {limit}")
        self.limit = limit
        self._free: list[HostBufferPool] = []
        self._made: list[HostBufferPool] = []
        self._cond = threading.Condition()

    @property
    def made(self) -> int:
        """Buffer sets allocated so far (1 while persists keep up, at most ``limit``)."""
        return len(self._made)

    @property
    def allocations(self) -> int:
        """Host tensors allocated over all sets; constant in steady state."""
        return sum(p.allocations for p in self._made)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._made)

    def has_free(self) -> bool:
        """True when ``try_acquire`` would succeed now."""
        with self._cond:
            return bool(self._free) or len(self._made) < self.limit

    def try_acquire(self) -> HostBufferPool | None:
        """A free set (a new one while under ``limit``), or None when every set is in use."""
        with self._cond:
            return self._take_locked()

    def acquire(self) -> tuple[HostBufferPool, float]:
        """A free set, waiting for a persist to release one; returns it and seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            pool = self._take_locked()
            while pool is None:
                self._cond.wait()
                pool = self._take_locked()
        return pool, time.perf_counter() - t0

    def release(self, pool: HostBufferPool) -> None:
        """Give back a set whose snapshot is written (called by the persist thread)."""
        with self._cond:
            if any(p is pool for p in self._free):
                return  # released twice (a failed persist): keep one entry
            self._free.append(pool)
            self._cond.notify()

    def _take_locked(self) -> HostBufferPool | None:
        if self._free:
            # Most recently released first: its pages are the warmest.
            return self._free.pop()
        if len(self._made) < self.limit:
            pool = HostBufferPool()
            self._made.append(pool)
            return pool
        return None


@dataclass(eq=False)
class Snapshot:
    """One phase-1 copy: host tensors that become valid once ``wait`` returns."""

    step: int
    tensors: dict[str, torch.Tensor]
    skeleton: dict[str, Any]
    buffers: HostBufferPool | None = None
    """The buffer set ``tensors`` live in (all but XLA ones, which are the snapshot's own);
    released once the snapshot is persisted."""
    started: float = field(default_factory=time.perf_counter)
    copied: float | None = None
    """perf_counter time when every tensor was on the host."""
    boxes: dict[str, Box] = field(default_factory=dict)
    """Where a host tensor sits in its global tensor when it is one of several boxes of it
    (the shards of an SPMD tensor); filled once the transfer is done."""
    _cpu_done: Future[None] | None = None
    _xla_done: Future[None] | None = None
    """The transfer of the XLA tensors' frozen copies; the optimizer step never waits for it."""
    _cuda_events: list[tuple[int, Any]] = field(default_factory=list)
    _cuda: CudaCopier | None = None

    def done(self) -> bool:
        cpu = self._cpu_done is None or self._cpu_done.done()
        cpu = cpu and (self._xla_done is None or self._xla_done.done())
        return cpu and all(e.query() for _, e in self._cuda_events)

    def wait(self) -> None:
        """Block until every host tensor holds its copy (called by the persist thread)."""
        if self._cpu_done is not None:
            self._cpu_done.result()
        if self._xla_done is not None:
            self._xla_done.result()
        for _, event in self._cuda_events:
            event.synchronize()
        if self.copied is None:
            self.copied = time.perf_counter()

    def block_optimizer(self) -> float:
        """Make the next optimizer step wait for the copy; returns seconds the host waited.

        CUDA copies are ordered on the device (the current stream waits on the copy's event),
        so the host does not stall for them; a CPU copy in flight is waited for here.
        """
        if self._cuda is not None:
            for device, event in self._cuda_events:
                self._cuda.order_after(device, event)
        if self._cpu_done is None or self._cpu_done.done():
            return 0.0
        t0 = time.perf_counter()
        self._cpu_done.result()
        return time.perf_counter() - t0


@dataclass(frozen=True, slots=True)
class Box:
    """One of several host tensors of a global tensor ``fqn``, at ``offset``."""

    fqn: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


class CudaCopier:
    """Device-to-host copies on one side stream per device, ordered by events.

    Args:
        cuda: the ``torch.cuda`` module (a stand-in in CPU-only unit tests).
    """

    def __init__(self, cuda: Any = torch.cuda) -> None:
        self.cuda = cuda
        self._streams: dict[int, Any] = {}

    def copy(self, device: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue ``dst.copy_(src)`` for every pair; returns the event that marks the end."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self.cuda.Stream(device=device)
        # The side stream starts after the work already queued (the optimizer step that
        # produced these weights), so the copy sees finished weights without a host sync.
        stream.wait_stream(self.cuda.current_stream(device))
        with self.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = self.cuda.Event()
            event.record(stream)
        return event

    def order_after(self, device: int, event: Any) -> None:
        """Make work queued next on the device (the optimizer step) wait for ``event``.

        The device waits, not the host: training keeps queueing kernels."""
        self.cuda.current_stream(device).wait_event(event)


class Snapshotter:
    """Starts snapshots; owns the copy thread, the CUDA side streams and the buffer sets.

    Args:
        buffer_sets: how many host copies of the state may exist (2: one being persisted,
            one being filled).
        cuda: the ``torch.cuda`` module (a stand-in in CPU-only unit tests).
    """

    def __init__(self, buffer_sets: int = 2, cuda: Any = None) -> None:
        self.buffers = BufferSets(buffer_sets)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkflow-copy")
        self.cuda = CudaCopier() if cuda is None else CudaCopier(cuda)
        self.xla_devices: set[int] | None = None
        """The XLA devices whose SPMD shards this process writes (None: all it holds)."""

    def take(
        self, step: int, flat: FlatState, protected: set[int], pool: HostBufferPool
    ) -> Snapshot:
        """Start copying ``flat`` into ``pool``; ``protected`` holds data pointers that only
        an optimizer step changes.

        Returns once every tensor that the next forward pass may change in place is safe:
        CPU ones are copied, CUDA ones are ordered before the device's next work.
        """
        hosts: dict[str, torch.Tensor] = {}
        background: list[tuple[torch.Tensor, torch.Tensor]] = []
        by_cuda: dict[int, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}
        on_xla: dict[str, torch.Tensor] = {}
        for fqn, src in flat.tensors.items():
            src = src.detach()
            if xla.is_xla(src):
                on_xla[fqn] = src
                continue
            dst = pool.buffer_for(fqn, src)
            hosts[fqn] = dst
            is_protected = _data_ptr(src) in protected
            if src.is_cuda:
                by_cuda.setdefault(src.device.index or 0, []).append((dst, src, is_protected))
            elif is_protected:
                background.append((dst, src))
            else:
                dst.copy_(src)
        snap = Snapshot(step=step, tensors=hosts, skeleton=flat.skeleton, buffers=pool)
        for device, triples in by_cuda.items():
            # Unprotected tensors (BatchNorm statistics…) first, so one event marks them.
            unprotected = [(d, s) for d, s, p in triples if not p]
            rest = [(d, s) for d, s, p in triples if p]
            if unprotected:
                event = self.cuda.copy(device, unprotected)
                snap._cuda_events.append((device, event))
                # The next forward pass changes these in place: the device (not the host)
                # must finish copying them before it runs anything queued after take().
                self.cuda.order_after(device, event)
            if rest:
                snap._cuda_events.append((device, self.cuda.copy(device, rest)))
        if by_cuda:
            snap._cuda = self.cuda
        if background:
            snap._cpu_done = self._executor.submit(_copy_all, background)
        if on_xla:
            _XlaCopy(snap, self.xla_devices).start(on_xla, self._executor)
        return snap

    def release(self, snap: Snapshot) -> None:
        """The snapshot is persisted (or failed): its buffer set may be reused."""
        if snap.buffers is not None:
            self.buffers.release(snap.buffers)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


def _data_ptr(t: torch.Tensor) -> int:
    if xla.is_xla(t):  # no storage: torch_xla's tensor id stands in for one
        return xla.identity(t)
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, fake)
        return 0


class _XlaCopy:
    """The XLA tensors of one snapshot to its host buffers, the optimizer step not waiting.

    ``start`` (training thread) freezes the tensors: one graph cut that also makes device
    copies of them. Reading the tensors themselves would have to end before the next step
    runs, since that step donates their buffers to its graph: training would wait for the
    whole transfer. The copies belong to the snapshot alone, so the copy thread moves them
    in bulk while training goes on and drops them, freeing their device memory.

    The host tensors torch_xla's transfers return (it has no transfer into a given buffer)
    become the snapshot's own: copying them into the reused buffer set, as CPU and CUDA
    state is, would cost one more pass over the state per checkpoint on the cores training
    uses (overhead 30 % -> 20 % at K=5 in ``benchmarks/xla.py``). They live until the
    snapshot is dropped after its persist; the buffer set stays the bound on how many
    snapshots exist at once, so host memory is still at most one copy per set.
    """

    def __init__(self, snap: Snapshot, devices: set[int] | None) -> None:
        self.snap, self.devices = snap, devices

    def start(self, tensors: dict[str, torch.Tensor], executor: ThreadPoolExecutor) -> None:
        frozen = dict(zip(tensors, xla.freeze(list(tensors.values())), strict=True))
        self.snap._xla_done = executor.submit(self.move, frozen)

    def move(self, tensors: dict[str, torch.Tensor]) -> None:
        sharded = {f: t for f, t in tensors.items() if xla.is_sharded(t)}
        whole = [f for f in tensors if f not in sharded]
        hosts = dict(zip(whole, xla.to_host([tensors[f] for f in whole]), strict=True))
        shards = xla.local_shards(list(sharded.values()), self.devices)
        shapes = {f: tuple(t.shape) for f, t in sharded.items()}
        tensors.clear()  # the device copies are not needed past the transfer
        sharded.clear()
        for fqn, src in hosts.items():
            self._put(fqn, src)
        for (fqn, shape), per_device in zip(shapes.items(), shards, strict=True):
            for shard in per_device:
                key = f"{fqn}@{shard.device}"
                self.snap.boxes[key] = Box(fqn, shape, shard.offset)
                self._put(key, shard.data)

    def _put(self, key: str, src: torch.Tensor) -> None:
        # A shard cut out of torch_xla's padded one is a view: made whole once here.
        self.snap.tensors[key] = src if src.is_contiguous() else src.contiguous()


def protected_pointers(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storage pointers of every parameter and optimizer-state tensor of ``optimizers``."""
    out: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out.add(_data_ptr(p))
        for per_param in opt.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    out.add(_data_ptr(v))
    out.discard(0)
    return out
