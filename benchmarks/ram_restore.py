"""Restore from the RAM tier vs from storage, for a state of at least 1 GiB (issue 11).

One checkpoint of a ``--gib`` GiB state (float32 tensors of 64 MiB, one chunk each,
``exact`` codec) is written to both tiers: storage (a local folder on disk, or with
``--s3`` S3 as a moto server on 127.0.0.1, over HTTP) and the RAM tier (``/dev/shm``).
Then, ``--repeats`` times and interleaved, a fresh ``Checkpointer`` restores it once from
each tier into fresh tensors. Before every storage
restore the storage files are dropped from the page cache (``posix_fadvise DONTNEED``), so
storage is read from the disk, as after a node's restart; the RAM tier is memory by nature.
Prints each time and the medians; the issue's target is RAM >= 5x faster.

    .venv/bin/python benchmarks/ram_restore.py              # 1 GiB, 5 repeats
    .venv/bin/python benchmarks/ram_restore.py --s3         # storage: S3 (moto)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import evict  # noqa: E402

from checkflow import Checkpointer  # noqa: E402

TENSOR_BYTES = 64 << 20


class Blob:
    """A state object of ``n`` float32 tensors of 128 MiB."""

    def __init__(self, n: int, fill: float) -> None:
        self.tensors = {f"t{i}": torch.full((TENSOR_BYTES // 4,), fill + i) for i in range(n)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self.tensors[k].copy_(v)


def s3_storage() -> tuple[object, str, dict]:
    """A moto S3 server (the tests' own helper) with a bucket: server, URI, options."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.moto_server import start_moto
    from tests.support.s3 import s3_options

    server, endpoint = start_moto()
    options = {"storage_options": s3_options(endpoint)}
    import boto3

    keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
    s3.create_bucket(Bucket="bench")
    return server, "s3://bench/run", options


def restore_s(uri: str, n: int, ram: str | None, options: dict) -> tuple[float, str]:
    blob = Blob(n, fill=-1.0)
    ckpt = Checkpointer(uri, {"blob": blob}, every=1, rng=False, ram_dir=ram, **options)
    t0 = time.perf_counter()
    ckpt.restore(step=1)
    took = time.perf_counter() - t0
    ckpt.close()
    assert torch.equal(blob.tensors["t0"], torch.full((TENSOR_BYTES // 4,), 0.0))
    return took, ckpt.restored_from


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--s3", action="store_true", help="storage: S3 (a moto server, HTTP)")
    args = p.parse_args()
    n = max(1, round(args.gib * (1 << 30) / TENSOR_BYTES))
    work = tempfile.mkdtemp(prefix="ram-restore-", dir="/var/tmp")
    ram = f"/dev/shm/checkflow-bench-{uuid.uuid4().hex[:8]}"
    options: dict = {}
    server = None
    try:
        uri = os.path.join(work, "ckpt")
        if args.s3:
            server, uri, options = s3_storage()
        blob = Blob(n, fill=0.0)
        with Checkpointer(uri, {"blob": blob}, every=1, rng=False, ram_dir=ram, **options) as c:
            c.step()
        del blob
        print(f"state {n * TENSOR_BYTES / (1 << 30):.2f} GiB; storage {uri}; RAM tier {ram}")
        times: dict[str, list[float]] = {"ram": [], "storage": []}
        for i in range(args.repeats):
            took, tier = restore_s(uri, n, ram, options)
            assert tier == "ram", tier
            times["ram"].append(took)
            if not args.s3:
                evict(uri)
            took, tier = restore_s(uri, n, None, options)
            assert tier == "storage", tier
            times["storage"].append(took)
            print(f"repeat {i + 1}: RAM {times['ram'][-1]:.2f} s, storage {took:.2f} s")
        ram_s, storage_s = (statistics.median(times[k]) for k in ("ram", "storage"))
        print(
            f"median of {args.repeats}: RAM tier {ram_s:.2f} s, storage {storage_s:.2f} s: "
            f"RAM {storage_s / ram_s:.1f}x faster"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
