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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from checkflow import xla
from checkflow.state import FlatState
from checkflow.write.buffers import BufferSets, HostBufferPool

log = logging.getLogger(__name__)


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
    _cpu_order: dict[str, int] = field(default_factory=dict)
    """Background-copied host tensors by their place in the copy thread's order."""
    _cpu_progress: CopyProgress | None = None
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

    def ready(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(fqn, host tensor)`` in order, each once it holds its copy (persist thread).

        A CPU tensor copied in the background comes as soon as the copy thread is past it,
        so the persist thread writes the first tensors while later ones are still copied
        (the copy of a 512 MiB shard is most of a second on two busy cores); CUDA and XLA
        tensors come once all of them are on the host.
        """
        if self._xla_done is not None:
            self._xla_done.result()
        for _, event in self._cuda_events:
            event.synchronize()
        for fqn, tensor in list(self.tensors.items()):
            index = self._cpu_order.get(fqn)
            progress = self._cpu_progress
            if index is not None and progress is not None and not progress.wait_past(index):
                assert self._cpu_done is not None
                self._cpu_done.result()  # the copy failed: raise its error
            yield fqn, tensor
        self.wait()

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


class CopyProgress:
    """How many of a snapshot's background copies are done, for ``Snapshot.ready``."""

    def __init__(self) -> None:
        self.copied = 0
        self.finished = False
        """All copied, or the copy failed."""
        self._cond = threading.Condition()

    def advance(self) -> None:
        with self._cond:
            self.copied += 1
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def wait_past(self, index: int) -> bool:
        """Wait until copy ``index`` is done (True) or the copy stopped short of it."""
        with self._cond:
            self._cond.wait_for(lambda: self.copied > index or self.finished)
            return self.copied > index


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
        order: dict[str, int] = {}  # fqn -> its place in ``background``
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
                order[fqn] = len(background)
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
            snap._cpu_order = order
            snap._cpu_progress = progress = CopyProgress()
            snap._cpu_done = self._executor.submit(_copy_all, background, progress)
        if on_xla:
            _XlaCopy(snap, self.xla_devices).start(on_xla, self._executor)
        return snap

    def release(self, snap: Snapshot) -> None:
        """The snapshot is persisted (or failed): its buffer set may be reused."""
        if snap.buffers is not None:
            self.buffers.release(snap.buffers)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], progress: CopyProgress) -> None:
    try:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
                progress.advance()
    finally:
        progress.finish()


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
