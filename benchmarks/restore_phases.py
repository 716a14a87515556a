"""Where one thread's time goes when a checkpoint of ``restore.py``'s state is restored.

The 288 MiB MLP + AdamW of ``overhead.py``, trained 4 steps, saved once with ``--codec``;
then, for its chunks of 1 MiB or more, on one thread and in the order a restore takes:
the read (a private mapping of the page cache), xxh3, ``Codec.decode_into`` into tensors
shaped like the live ones, and for ``zstd`` its two parts (the planes decompressed, and
their interleave into the tensors, with and without non-temporal stores). Medians of
``--repeats`` after one warm-up pass. Also lists how the zstd planes were stored.

Then whole restores (``Checkpointer.restore()`` into a live model and optimizer, as in
``restore.py``) with every ``CheckpointReader.chunk`` call timed on the read threads: the
restore's wall time against the threads' busy time, and what is left idle (threads x wall
- busy: a read thread waiting for work while the restore runs).

    .venv/bin/python benchmarks/restore_phases.py --codec zstd
    .venv/bin/python benchmarks/restore_phases.py --codec exact
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import build, layers_for, train_step  # noqa: E402
from restore import CheckflowCase  # noqa: E402

from checkflow import knobs  # noqa: E402
from checkflow import manifest as mf  # noqa: E402
from checkflow.catalog import committed_steps  # noqa: E402
from checkflow.codec import _native, get_codec  # noqa: E402
from checkflow.codec import zstd as zstd_codec  # noqa: E402
from checkflow.codec.base import dtype_from_name  # noqa: E402
from checkflow.read.reader import CheckpointReader  # noqa: E402
from checkflow.storage import Storage  # noqa: E402


def saved_chunks(codec: str, root: str) -> tuple[Storage, int, list[mf.ChunkEntry]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batches = [(torch.randn(64, 2048), torch.randn(64, 2048)) for _ in range(4)]
    model, opt = build(2048, layers_for(96.0, 2048))
    for b in batches:
        train_step(model, opt, b)
    CheckflowCase(codec, root).write(model, opt, batches)
    storage = Storage(root)
    step = max(committed_steps(storage))
    chunks = CheckpointReader(storage).rank_manifest(step, 0).chunks
    return storage, step, [c for c in chunks if c.nbytes >= 1 << 20]


def timed(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: page cache, first touch of the outputs
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--codec", default="zstd")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    root = os.path.join(tempfile.mkdtemp(prefix="checkflow-phases-"), args.codec)
    storage, step, chunks = saved_chunks(args.codec, root)
    path = [f"{mf.step_dir(step)}/{c.file}" for c in chunks]
    data = [
        storage.read(f, c.byte_offset, c.byte_offset + c.nbytes)
        for f, c in zip(path, chunks, strict=True)
    ]
    outs = [torch.empty(tuple(c.shape), dtype=dtype_from_name(c.dtype)) for c in chunks]
    mib = sum(o.nbytes for o in outs) / 2**20
    print(f"{len(chunks)} chunks, {mib:.0f} MiB decoded, codec {args.codec}, one thread")

    def read() -> None:
        for f, c in zip(path, chunks, strict=True):
            storage.read(f, c.byte_offset, c.byte_offset + c.nbytes)

    def checksum() -> None:
        for d in data:
            xxhash.xxh3_64_hexdigest(d)

    def decode() -> None:
        for c, d, o in zip(chunks, data, outs, strict=True):
            get_codec(c.codec).decode_into(d, c.params, o)

    phases = {
        "read (mapped page cache)": read,
        "xxh3": checksum,
        "decode_into live tensors": decode,
    }
    if args.codec == "zstd":
        phases.update(zstd_parts(chunks, data, outs))
    for name, run in phases.items():
        print(f"  {name:48s} {timed(run, args.repeats) * 1e3:7.1f} ms")
    read_threads_busy(args.codec, root, args.repeats)


def read_threads_busy(codec: str, root: str, repeats: int) -> None:
    """Whole restores of the saved checkpoint, each chunk's decode timed on its thread."""
    batches = [(torch.randn(64, 2048), torch.randn(64, 2048)) for _ in range(4)]
    model, opt = build(2048, layers_for(96.0, 2048))
    train_step(model, opt, batches[0])  # optimizer state exists: restores go in place
    case = CheckflowCase(codec, root)
    busy: list[float] = []
    lock = threading.Lock()
    chunk = CheckpointReader.chunk

    def timed_chunk(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return chunk(self, *args, **kwargs)
        finally:
            with lock:
                busy.append(time.perf_counter() - t0)

    CheckpointReader.chunk = timed_chunk  # type: ignore[method-assign]
    try:
        case.restore(model, opt)  # warm-up
        walls, totals = [], []
        for _ in range(repeats):
            busy.clear()
            t0 = time.perf_counter()
            case.restore(model, opt)
            walls.append(time.perf_counter() - t0)
            totals.append(sum(busy))
    finally:
        CheckpointReader.chunk = chunk  # type: ignore[method-assign]
    threads = knobs.read_threads()
    wall, work = statistics.median(walls), statistics.median(totals)
    print(
        f"whole restores, {threads} read threads (medians of {repeats}): wall "
        f"{wall * 1e3:.1f} ms, read threads busy {work * 1e3:.1f} ms, idle "
        f"{(threads * wall - work) * 1e3:.1f} ms"
    )


def zstd_parts(
    chunks: list[mf.ChunkEntry], data: list, outs: list[torch.Tensor]
) -> dict[str, Callable[[], None]]:
    kinds = Counter(e[0] for c in chunks for e in c.params["planes"])
    print("  planes stored as: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    planes = [
        [bytes(p) for p in zstd_codec._unpack_planes(d, c.params["planes"], o.numel())]
        for c, d, o in zip(chunks, data, outs, strict=True)
    ]
    kernel = _native.load()

    def unpack() -> None:
        for c, d, o in zip(chunks, data, outs, strict=True):
            zstd_codec._unpack_planes(d, c.params["planes"], o.numel(), reuse=True)

    def interleave(stream: int) -> Callable[[], None]:
        def run() -> None:
            for pl, o in zip(planes, outs, strict=True):
                arrays = [np.frombuffer(x, dtype=np.uint8) for x in pl]
                pointers = (ctypes.c_void_p * len(pl))(*[a.ctypes.data for a in arrays])
                kernel._unshuffle_planes(pointers, o.data_ptr(), o.numel(), len(pl), stream)

        return run

    def by_kind(kind: str) -> Callable[[], None]:
        """Only the planes stored as ``kind``, decoded as ``_unpack_planes`` does."""

        def run() -> None:
            for c, d, o in zip(chunks, data, outs, strict=True):
                view, pos = memoryview(d).cast("B"), 0
                for index, entry in enumerate(c.params["planes"]):
                    piece, pos = view[pos : pos + entry[1]], pos + entry[1]
                    if entry[0] == kind == "zstd":
                        zstd_codec._decompress(piece, o.numel(), index, True)
                    elif entry[0] == kind == "nib4":
                        zstd_codec._decode_nibbles(piece, entry, o.numel(), index, True)

        return run

    parts = {
        "  planes decompressed (all)": unpack,
        "    exponent planes (nib4: zstd + 4-bit codes)": by_kind("nib4"),
        "    other planes stored as zstd frames": by_kind("zstd"),
    }
    if kernel is not None:
        parts["  interleave, non-temporal stores (now)"] = interleave(1)
        parts["  interleave, ordinary stores"] = interleave(0)
    return parts


if __name__ == "__main__":
    main()
