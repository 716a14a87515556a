"""Where a checkflow checkpoint's CPU goes: thread CPU of each persist phase, per GiB.

Saves the overhead benchmark's model + AdamW state N times with ``Checkpointer.save()``
(waited for, one training step between), and adds up the CPU time (``time.thread_time``,
user + system) that the persist thread spends in each phase: the xxh3 checksums, writing
the files (``Storage._put_once``: the write itself plus fsync), fsync alone, the commit,
retention. The copy thread's CPU comes from ``/proc/self/task/<tid>/stat``. CPU seconds
move far less than wall times on a loaded machine, so a few checkpoints are enough.

    python benchmarks/persist_cpu.py                       # O_DIRECT writes (the default)
    CHECKFLOW_DIRECT_IO=0 python benchmarks/persist_cpu.py # through the page cache
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import CpuSample, CpuUse, build, layers_for, train_step  # noqa: E402

import checkflow.storage.atomic as atomic  # noqa: E402
import checkflow.storage.store as store  # noqa: E402
import checkflow.write.persist as persist  # noqa: E402
from checkflow import Checkpointer  # noqa: E402

spent: dict[str, float] = collections.defaultdict(float)


def timed_cpu(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding the calling thread's CPU seconds inside it to ``spent[label]``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.thread_time() - c0

    return wrapper


def instrument() -> None:
    for label in ("file writes incl. fsync", "  of which fsync", "xxh3 checksums"):
        spent[label] = 0.0  # printed in this order
    persist.checksum = timed_cpu("xxh3 checksums", persist.checksum)
    persist.apply_retention = timed_cpu("retention (deletes)", persist.apply_retention)
    persist.write_commit = timed_cpu("commit (MANIFEST.json)", persist.write_commit)
    persist.objects.encode = timed_cpu("objects.encode", persist.objects.encode)
    store.Storage._put_once = timed_cpu("file writes incl. fsync", store.Storage._put_once)
    atomic.os.fsync = timed_cpu("  of which fsync", os.fsync)
    persist.PersistWorker._persist = timed_cpu(
        "persist thread total", persist.PersistWorker._persist
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--params-mib", type=float, default=96.0)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--codec", default="exact")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, opt = build(args.hidden, layers_for(args.params_mib, args.hidden))
    batch = (torch.randn(64, args.hidden), torch.randn(64, args.hidden))
    for _ in range(2):
        train_step(model, opt, batch)
    tensors = list(model.state_dict().values())
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = tempfile.mkdtemp(prefix="persist-cpu-", dir=args.dir)
    try:
        ck = Checkpointer(root, {"model": model, "optim": opt}, every=10**9, codec=args.codec)
        ck.open()
        ck.save().result()  # buffers allocated, files exist: steady state from here
        instrument()
        a = CpuSample.now()
        for _ in range(args.checkpoints):
            ck.save().result()
            train_step(model, opt, batch)
            ck.step()
        use = CpuUse.between(a, CpuSample.now())
        ck.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = args.checkpoints * nbytes / 2**30
    direct = os.environ.get("CHECKFLOW_DIRECT_IO", "1")
    print(
        f"{args.checkpoints} checkpoints of {nbytes / 2**20:.0f} MiB ({args.codec}, "
        f"CHECKFLOW_DIRECT_IO={direct}); CPU seconds per GiB checkpointed:"
    )
    for name, cpu in sorted(use.by_thread.items(), key=lambda kv: -kv[1]):
        print(f"  thread {name:<28} {cpu / gib:6.3f}")
    for label, cpu in spent.items():
        print(f"  {label:<35} {cpu / gib:6.3f}")
    print(f"  {'every thread but training':<35} {use.background / gib:6.3f}")


if __name__ == "__main__":
    main()
