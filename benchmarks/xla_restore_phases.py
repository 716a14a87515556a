"""``xla.py`` with checkflow's restore taken apart, in the benchmark's own process.

Runs ``benchmarks/xla.py`` unchanged (same arguments) and, around each restore, prints:
the phases of checkflow's (``read_tiered``: read, verify, decode; ``load_into``: refill on
the device), the process's user and system CPU, and ``/proc/vmstat`` deltas (``pgpgin``:
KiB read from the disk; refaults and reclaim: whether pages were read twice).

``--path mapped`` restores as checkflow did before 95f6bae, to compare in the same
machine state: every chunk mapped from the page cache, the whole state on the host, then
``load_state_dict``. The default (``landed``) is checkflow's own path: each tensor read with
``O_DIRECT`` into reused buffers and copied into its live XLA tensor at once.

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_restore_phases.py --repeats 3
    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_restore_phases.py --repeats 3 --path mapped

``--touch-mib N`` first times the first touch of N MiB of new anonymous memory (one write
per page), three times, before each of checkflow's restores: how fast the process gets new
pages at that moment (the mapped path's page-cache pages are new pages too).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xla as bench  # noqa: E402

import checkflow.checkpointer as checkpointer_module  # noqa: E402
import checkflow.parallel.adapters as adapters  # noqa: E402
from checkflow import resume  # noqa: E402

VMSTAT = ("pgpgin", "pgmajfault", "workingset_refault_file", "pgsteal_kswapd", "pgsteal_direct")
phases: dict[str, float] = {}


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


def first_touch(mib: int) -> str:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with mmap.mmap(-1, mib << 20) as m:
            for offset in range(0, len(m), mmap.PAGESIZE):
                m[offset] = 1
            times.append(time.perf_counter() - t0)
    return ", ".join(f"{t:.3f} s" for t in times)


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--path", choices=["landed", "mapped"], default="landed")
    p.add_argument("--touch-mib", type=int, default=0)
    ours, rest = p.parse_known_args()
    resume.read_tiered = timed_phase("read_tiered", resume.read_tiered)
    checkpointer_module.load_into = timed_phase("load_into", checkpointer_module.load_into)
    if ours.path == "mapped":
        # No live XLA targets: nothing lands as it is read, and the reader maps.
        adapters.live_xla_targets = lambda state: {}
    restore = bench.Run.restore

    def traced_restore(run: Any) -> None:
        if run.ckpt is None:
            return restore(run)
        if ours.touch_mib:
            print(f"    first touch of {ours.touch_mib} MiB: {first_touch(ours.touch_mib)}")
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
