"""Stand-in hosts restoring an SPMD checkpoint: what each reads from storage.

Run with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``. The checkpoint is written by the stand-in
hosts of ``_spmd_hosts`` (a 2 x 2 mesh, hosts {0, 1} and {2, 3}) into fsspec's in-memory
filesystem, and read back through ``recmem://``: the same filesystem, whose ``cat_file``
also records every byte range asked for. Then:

- each stand-in host reads the boxes of its own devices (``read_xla_boxes``), onto the
  same 2 x 2 mesh and onto a 1-D mesh of 4; torch_xla places shards on every local device
  at once, so the union of the hosts' boxes is placed (``xla.place``) and compared;
- the whole process restores through ``Checkpointer.restore``: every chunk is read once,
  and the parameters and the optimizer state come back sharded as the live ones.

Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch_xla
import torch_xla.runtime as xr
from fsspec.implementations.memory import MemoryFileSystem

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _spmd_hosts import HOSTS, build, on_cpu, train, write_as_hosts  # noqa: E402

from checkflow import Checkpointer, xla  # noqa: E402
from checkflow import manifest as mf  # noqa: E402
from checkflow.distributed import live_state  # noqa: E402
from checkflow.read.reader import CheckpointReader  # noqa: E402
from checkflow.read.state_dicts import read_xla_boxes  # noqa: E402
from checkflow.storage import Storage  # noqa: E402

ROOT = "ckpt-host-reads"
STEP = 3


class RecordingMemoryFS(MemoryFileSystem):
    """fsspec's in-memory filesystem (same store) that records each ``cat_file`` range."""

    protocol = ("recmem",)
    reads: list[tuple[str, int, int | None]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("recmem://"):
            path = "memory://" + path[len("recmem://") :]
        return super()._strip_protocol(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        RecordingMemoryFS.reads.append((self._strip_protocol(path), start or 0, end))
        return super().cat_file(path, start=start, end=end, **kw)


fsspec.register_implementation("recmem", RecordingMemoryFS, clobber=True)


def stored_ranges(reader: CheckpointReader) -> dict[str, Any]:
    """Where every chunk and object of STEP lies: ``{(path, start, end): (rank, fqn)}``."""
    chunks, objects = {}, {}
    for rm in reader.rank_manifests(STEP):
        for c in rm.chunks:
            path = f"/{ROOT}/{mf.step_dir(STEP)}/{c.file}"
            chunks[(path, c.byte_offset, c.byte_offset + c.nbytes)] = (rm.rank, c.fqn)
        for o in rm.objects:
            path = f"/{ROOT}/{mf.step_dir(STEP)}/{o.file}"
            objects[(path, o.byte_offset, o.byte_offset + o.nbytes)] = (rm.rank, o.fqn)
    return {"chunks": chunks, "objects": objects}


def classify(reads: list[tuple[str, int, int | None]], where: dict[str, Any]) -> dict[str, Any]:
    """The chunks read (as ``[rank, fqn, nbytes]``), how often, and any other read."""
    chunks, other, objects = [], [], 0
    for read in reads:
        if read in where["chunks"]:
            rank, fqn = where["chunks"][read]
            chunks.append([rank, fqn, read[2] - read[1]])
        elif read in where["objects"]:
            objects += 1
        elif not read[0].endswith(".json"):
            other.append(list(read))
    return {"chunks": chunks, "objects": objects, "other": other}


def hosts_read(mesh_shape: tuple[int, ...], expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each stand-in host reads its boxes onto a fresh model on ``mesh_shape``; the union
    is placed on the devices and compared with ``expected``."""
    model, opt = build(mesh_shape, seed=7)
    state = {"model": model, "optim": opt}
    live = live_state(state)
    reader = CheckpointReader(Storage(f"recmem://{ROOT}"))
    where = stored_ranges(reader)
    per_host: dict[int, Any] = {}
    union: dict[str, dict[xla.Box, torch.Tensor]] = {}
    for host, devices in HOSTS.items():
        RecordingMemoryFS.reads.clear()
        boxes = read_xla_boxes(reader, STEP, live, devices)
        per_host[host] = classify(list(RecordingMemoryFS.reads), where)
        per_host[host]["boxes"] = {f: [list(map(list, b)) for b in got] for f, got in boxes.items()}
        for fqn, got in boxes.items():
            union.setdefault(fqn, {}).update(got)
    placed = {
        fqn: xla.place(live.xla_layout_for(fqn, expected[fqn].shape), got)
        for fqn, got in union.items()
    }
    torch_xla.sync()
    equal = sorted(placed) == sorted(expected) and all(
        torch.equal(placed[f].cpu(), expected[f]) for f in expected
    )
    specs = {f: xla.spec(t) for f, t in placed.items()}
    live_specs = {f: xla.spec(t) for f, t in _live_tensors(model).items()}
    return {
        "hosts": per_host,
        "equal": equal,
        "same_sharding": all(specs[f] == live_specs[f] for f in live_specs),
        "stored": sorted([r, f, e - s] for (_, s, e), (r, f) in where["chunks"].items()),
    }


def _live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in model.state_dict(keep_vars=True).items()}


def process_restores(expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The whole process restores through ``Checkpointer.restore`` onto the 2 x 2 mesh."""
    model, opt = build((2, 2), seed=11)
    before = {f: xla.spec(t) for f, t in _live_tensors(model).items()}
    RecordingMemoryFS.reads.clear()
    with Checkpointer(f"recmem://{ROOT}", {"model": model, "optim": opt}, rng=False) as ckpt:
        restored = ckpt.restore()
    reads = list(RecordingMemoryFS.reads)
    torch_xla.sync()
    got = on_cpu(model, opt)
    where = stored_ranges(CheckpointReader(Storage(f"memory://{ROOT}")))
    after = {f: xla.spec(t) for f, t in _live_tensors(model).items()}
    optim_specs = {
        f"{i}.{k}": xla.spec(v)
        for i, per_param in opt.state_dict()["state"].items()
        for k, v in per_param.items()
        if v.dim() > 0
    }
    params = list(_live_tensors(model))
    return {
        "restored": restored,
        "reads": classify(reads, where),
        "equal": all(torch.equal(got[k], expected[k]) for k in expected),
        "param_sharding_kept": before == after,
        "param_specs": after,
        "optim_specs": optim_specs,
        "param_order": params,
    }


def main() -> None:
    xr.use_spmd()
    model, opt = build((2, 2), seed=0)
    train(model, opt, STEP)
    expected = on_cpu(model, opt)
    write_as_hosts(f"memory://{ROOT}", {"model": model, "optim": opt}, step=STEP)
    sharded = {f: t for f, t in expected.items() if t.dim() > 0}
    report = {
        "same_mesh": hosts_read((2, 2), sharded),
        "other_mesh": hosts_read((4,), sharded),
        "process": process_restores(expected),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
