"""``xla.py`` with checkflow's restore taken apart, in the benchmark's own process.

Runs ``benchmarks/xla.py`` unchanged (same arguments) and, around each restore, prints:
the phases of checkflow's (``read_tiered``: read, verify, decode; ``load_into``: refill on
the device), the process's user and system CPU, and ``/proc/vmstat`` deltas (``pgpgin``:
KiB read from the disk; refaults and reclaim: whether pages were read twice).

``--read direct`` is the measured lead of issue 12: local chunks are read with
``O_DIRECT`` into page-aligned buffers allocated and written once before the timed
restore (enough for ``--pool-mib``), instead of mapped from the page cache; it prints how
long touching those buffers took. A probe, not a proposal: nothing here is in checkflow.

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_restore_phases.py --repeats 1
    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_restore_phases.py --repeats 1 --read direct
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from typing import Any, BinaryIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xla as bench  # noqa: E402

import checkflow.checkpointer as checkpointer_module  # noqa: E402
import checkflow.storage.store as store_module  # noqa: E402
from checkflow import resume  # noqa: E402

VMSTAT = ("pgpgin", "pgmajfault", "workingset_refault_file", "pgsteal_kswapd", "pgsteal_direct")
phases: dict[str, float] = {}
pool: list[mmap.mmap] = []


def timed_phase(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in VMSTAT}


def read_direct(f: BinaryIO, start: int, end: int) -> memoryview:
    """``[start, end)`` of ``f``, by O_DIRECT into a pool buffer (a fresh one if none fits)."""
    lo, hi = start - start % 4096, -(-end // 4096) * 4096
    fit = next((i for i, b in enumerate(pool) if len(b) >= hi - lo), None)
    buf = pool.pop(fit) if fit is not None else mmap.mmap(-1, hi - lo)
    fd = os.open(f.name, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(fd, [memoryview(buf)[: hi - lo]], lo)
    finally:
        os.close(fd)
    return memoryview(buf)[start - lo : end - lo]


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--read", choices=["mapped", "direct"], default="mapped")
    p.add_argument("--pool-mib", type=int, default=1024)
    ours, rest = p.parse_known_args()
    resume.read_tiered = timed_phase("read_tiered", resume.read_tiered)
    checkpointer_module.load_into = timed_phase("load_into", checkpointer_module.load_into)
    if ours.read == "direct":
        store_module.map_range = read_direct  # type: ignore[assignment]
    restore = bench.Run.restore

    def traced_restore(run: Any) -> None:
        if run.ckpt is None:
            return restore(run)
        if ours.read == "direct":
            pool.clear()
            t0 = time.perf_counter()
            for _ in range(ours.pool_mib // 16):
                buf = mmap.mmap(-1, (16 << 20) + 8192)
                buf.write(b"\x01" * len(buf))
                pool.append(buf)
            print(f"    pool of {ours.pool_mib} MiB touched in {time.perf_counter() - t0:.2f} s")
        phases.clear()
        v0, c0 = vmstat(), os.times()
        restore(run)
        v1, c1 = vmstat(), os.times()
        print(
            f"    checkflow restore {run.restore_s:.3f} s: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items())
            + f"; CPU user {c1.user - c0.user:.2f} s, sys {c1.system - c0.system:.2f} s; "
            + "vmstat "
            + ", ".join(f"{k} {v1[k] - v0[k]}" for k in VMSTAT),
            flush=True,
        )

    bench.Run.restore = traced_restore  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *rest]
    bench.main()


if __name__ == "__main__":
    main()
