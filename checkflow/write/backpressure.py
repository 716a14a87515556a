"""What a due checkpoint does while storage is slower than the interval (``when_busy``).

Both host buffer sets still being persisted means storage is behind, or failing: when the
newest persist failed (``stats.last_error``), the wait is logged as that failure, never as
a slow store. With ``"wait"`` the
training thread waits for a set, and the wait is counted and logged; with ``"skip"`` the
checkpoint is not taken and the skip is counted. Either way the log says why, at WARNING
for the 1st, 2nd, 4th, 8th... occurrence so that a persistent condition does not flood it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future

from checkflow.write.buffers import BufferSets, HostBufferPool
from checkflow.write.stats import CheckpointStats

log = logging.getLogger(__name__)


def acquire_buffer_set(buffers: BufferSets, stats: CheckpointStats, step: int) -> HostBufferPool:
    """A free host buffer set; waits (counted in ``stats``) while every set is persisting."""
    pool = buffers.try_acquire()
    if pool is not None:
        return pool
    pool, waited = buffers.acquire()
    stats.waits += 1
    stats.waited_s += waited
    n = stats.waits
    if stats.last_error:  # the persists failed: a slow store is not what is wrong
        log.log(
            _level(n),
            "checkpoint at step %d waited %.3fs for the previous persists, which are failing "
            "(%d failed so far; the newest: %s); fix the storage, a larger `every` will not help",
            step,
            waited,
            stats.failed,
            stats.last_error,
        )
        return pool
    log.log(
        _level(n),
        "checkpoint at step %d waited %.3fs for the previous persists: storage is slower "
        "than the checkpoint interval (%d waits, %.1fs in all); a larger `every` or "
        'every="auto" avoids this',
        step,
        waited,
        n,
        stats.waited_s,
    )
    return pool


def count_skip(stats: CheckpointStats, step: int, reason: str) -> None:
    """A due checkpoint of ``step`` was not taken (``when_busy="skip"``) because of ``reason``."""
    stats.skipped += 1
    n = stats.skipped
    log.log(
        _level(n),
        "checkpoint at step %d skipped (when_busy='skip'): %s (%d skipped so far)",
        step,
        reason,
        n,
    )


def _level(n: int) -> int:
    return logging.WARNING if n & (n - 1) == 0 else logging.DEBUG  # 1, 2, 4, 8...


def wait_for_all(futures: Iterable[Future[int]]) -> None:
    """Wait for every future, then raise the first error among them (if any).

    Raises:
        Exception: the first error of a failed persist.
    """
    errors = []
    for f in futures:
        try:
            f.result()
        except Exception as e:  # collect, so that every future is waited for
            errors.append(e)
    if errors:
        raise errors[0]


def done_future(step: int) -> Future[int]:
    """The future of a checkpoint that is committed already (the step just restored from
    storage): ``save()`` there returns it rather than write a committed step again."""
    future: Future[int] = Future()
    future.set_result(step)
    return future
