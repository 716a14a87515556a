"""Host buffers a snapshot copies into: one tensor per fqn, allocated once, in at most two sets.

While one set is being persisted, the next due snapshot goes into the other, so a checkpoint
is never skipped because storage is still busy; only when both are in use does the training
thread wait for one (``checkflow.write.backpressure`` counts that wait as a stall).
"""

from __future__ import annotations

import threading
import time

import torch


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
