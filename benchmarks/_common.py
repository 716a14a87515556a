"""Small helpers shared by the benchmarks: timing, medians, sizes, tables, the copy reference."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch


def median(xs: Iterable[float]) -> float:
    """Median, or NaN for no samples (a strategy that took no checkpoint)."""
    values = list(xs)
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return median(timed(fn) for _ in range(reps))


def dir_bytes(path: str) -> int:
    """Total size of the regular files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                continue  # removed while walking (retention of an async writer)
    return total


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (baselines that do not sync by themselves)."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def evict(folder: str) -> None:
    """Drop ``folder``'s files from the page cache (``posix_fadvise DONTNEED`` after an
    fsync): the next read comes from the disk, as after a node's restart. Two strategies'
    restores compare equally only this way: one that wrote with O_DIRECT (checkflow) leaves
    nothing cached, one that wrote through the page cache would be read from memory."""
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:  # deleted meanwhile (retention): nothing to drop
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model's and the optimizer's state (what a checkpoint holds)."""
    out = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    for per_param in opt.state.values():
        out.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return out


def plain_copy_s(tensors: Sequence[torch.Tensor], reps: int = 5) -> float:
    """Median time to ``copy_`` every tensor into buffers allocated (and touched) beforehand.

    This is the floor for any snapshot that must not let the next optimizer step change the
    weights under it: the bytes have to move once.
    """
    buffers = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        with torch.no_grad():
            for dst, src in zip(buffers, tensors, strict=True):
                dst.copy_(src)

    return median_time(copy, reps, warmup=1)


def pinned_copy_s(tensors: Sequence[torch.Tensor], reps: int = 5) -> float:
    """Median time to copy every (GPU) tensor into pinned host buffers allocated beforehand,
    non-blocking, then synchronize: the pinned-copy limit, the floor for a GPU snapshot."""
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def copy() -> None:
        with torch.no_grad():
            for dst, src in zip(buffers, tensors, strict=True):
                dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return median_time(copy, reps, warmup=1)


def fmt_bytes(n: float) -> str:
    if n != n:  # NaN
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_s(s: float, unit: str = "ms") -> str:
    if s != s:
        return "-"
    return f"{s * 1000:.1f} ms" if unit == "ms" else f"{s:.2f} s"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-markdown table (readable in a terminal too)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])
