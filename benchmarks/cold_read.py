"""Cold reads of checkpoint-sized chunks through ``mmap``: the GIL during the populate.

``--files`` files of 64 MiB are written once (fsynced), then ``--repeats`` times and
interleaved, each way reads all of them on 2 threads (as the reader's threads do) after
dropping them from the page cache (``_common.evict``): map, populate, xxh3 the chunk.

- ``mmap.madvise``: ``MADV_POPULATE_READ`` through Python's ``mmap.madvise``, which holds
  the GIL while the kernel reads (what ``checkflow/storage/mapped.py`` did before);
- ``populate``: ``checkflow.storage.mapped.populate``, through ctypes, which releases it.

Also prints how far a pure-Python thread got meanwhile (iterations per second): the GIL's
share. Prints medians with [min..max].

    .venv/bin/python benchmarks/cold_read.py                    # 14 files, 4 repeats
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import evict, median  # noqa: E402

from checkflow.storage.mapped import MADV_POPULATE_READ, populate  # noqa: E402

CHUNK = 64 << 20


def _with_mmap_madvise(m: mmap.mmap) -> None:
    m.madvise(MADV_POPULATE_READ)


WAYS: dict[str, Callable[[mmap.mmap], None]] = {
    "mmap.madvise": _with_mmap_madvise,
    "populate": populate,
}


def read_all(files: list[str], way: Callable[[mmap.mmap], None]) -> None:
    def one(path: str) -> None:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), CHUNK, access=mmap.ACCESS_COPY)
        way(m)
        xxhash.xxh3_64_hexdigest(m)
        m.close()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, files))


def measure(files: list[str], way: Callable[[mmap.mmap], None]) -> tuple[float, float]:
    """Seconds to read ``files`` cold, and a spinning Python thread's M iterations/s meanwhile."""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    t0 = time.perf_counter()
    read_all(files, way)
    dt = time.perf_counter() - t0
    stop.set()
    spinner.join()
    return dt, count[0] / dt / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=14)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="cold-read-", dir=args.dir)
    try:
        files = [os.path.join(root, f"c{i}") for i in range(args.files)]
        for path in files:
            with open(path, "wb") as f:
                f.write(os.urandom(CHUNK))
                f.flush()
                os.fsync(f.fileno())
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        spins: dict[str, list[float]] = {w: [] for w in WAYS}
        names = list(WAYS)
        for r in range(args.repeats):
            for name in names[r % 2 :] + names[: r % 2]:
                evict(root)
                time.sleep(0.3)
                dt, rate = measure(files, WAYS[name])
                times[name].append(dt)
                spins[name].append(rate)
                print(f"  [{r + 1}] {name:13s} {dt:.3f} s, Python thread {rate:.1f} M it/s")
        mib = args.files * CHUNK >> 20
        for name in names:
            t = times[name]
            print(
                f"{name:13s} {median(t):.3f} s [{min(t):.3f}..{max(t):.3f}] for {mib} MiB cold, "
                f"2 threads; a Python thread beside it {median(spins[name]):.1f} M it/s"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
