"""Stand-in hosts of an SPMD job: a 4-device virtual mesh split into 2 "hosts" of 2 devices.

Run with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``. One process holds every device here, so
each stand-in host is checkflow's write path (``Snapshotter`` + ``PersistWorker``) told
which devices are its own (``Snapshotter.xla_devices``) and which rank it is of 2. Each
writes only the shards of its devices; the last to finish commits. Then the union is read
back: whole on the CPU, and onto a 1-D mesh of the same devices. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from checkflow import Checkpointer, load  # noqa: E402
from checkflow.codec import CodecRules  # noqa: E402
from checkflow.state import flatten  # noqa: E402
from checkflow.storage import Storage  # noqa: E402
from checkflow.write.commit import CommitProtocol, RankResult  # noqa: E402
from checkflow.write.persist import PersistWorker  # noqa: E402
from checkflow.write.snapshot import Snapshotter, protected_pointers  # noqa: E402

HOSTS = {0: {0, 1}, 1: {2, 3}}


class LastOfTwoCommits(CommitProtocol):
    """The second host to persist a step commits it (the c10d store's count, in memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, int] = {}

    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        with self._lock:
            self._seen[step] = self._seen.get(step, 0) + 1
            return self._seen[step] == len(HOSTS)


def build(mesh_shape: tuple[int, ...], seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch_xla.device())
    axes = ("x", "y")[: len(mesh_shape)]
    mesh = xs.Mesh(np.arange(4), mesh_shape, axes)
    for p in model.parameters():
        xs.mark_sharding(p, mesh, ("x", "y" if len(axes) == 2 else None)[: p.dim()])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: Any, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
        nn.functional.mse_loss(
            model(x.to(torch_xla.device())), torch.zeros(32, 8).to(torch_xla.device())
        ).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()


def on_cpu(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.cpu() for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        out.update({f"optim.state.{i}.{k}": v.cpu() for k, v in per_param.items()})
    return out


def write_as_hosts(root: str, state: dict[str, Any], step: int) -> dict[int, list[Any]]:
    """Each stand-in host snapshots and persists its own shards of ``state``."""
    commit = LastOfTwoCommits()
    written: dict[int, list[Any]] = {}
    for rank, devices in HOSTS.items():
        snapper = Snapshotter()
        snapper.xla_devices = devices
        worker = PersistWorker(
            Storage(root),
            rank=rank,
            world_size=len(HOSTS),
            codecs=CodecRules("exact"),
            commit=commit,
            keep=0,
        )
        flat = flatten(state)
        snap = snapper.take(
            step, flat, protected_pointers([state["optim"]]), snapper.buffers.try_acquire()
        )
        worker.submit(snap).result(timeout=300)
        written[rank] = [
            (b.fqn, list(b.offset), list(snap.tensors[k].shape)) for k, b in snap.boxes.items()
        ]
        worker.close()
        snapper.close()
    return written


def main() -> None:
    root = sys.argv[1]
    xr.use_spmd()
    model, opt = build((2, 2), seed=0)
    train(model, opt, 3)
    expected = on_cpu(model, opt)
    written = write_as_hosts(root, {"model": model, "optim": opt}, step=3)

    whole = load(root, step=3)  # the union, read on the CPU
    flat_whole = {f"model.{k}": v for k, v in whole["model"].items()}
    for i, per_param in whole["optim"]["state"].items():
        flat_whole.update({f"optim.state.{i}.{k}": v for k, v in per_param.items()})
    cpu_equal = sorted(flat_whole) == sorted(expected) and all(
        torch.equal(flat_whole[k], expected[k]) for k in expected
    )

    other, other_opt = build((4,), seed=1)  # another mesh, other weights until restored
    with Checkpointer(root, {"model": other, "optim": other_opt}, rng=False) as ckpt:
        restored = ckpt.restore()
    got = on_cpu(other, other_opt)
    mesh_equal = all(torch.equal(got[k], expected[k]) for k in expected)
    print(
        json.dumps(
            {
                "written": written,
                "cpu_equal": cpu_equal,
                "mesh_equal": mesh_equal,
                "restored": restored,
            }
        )
    )


if __name__ == "__main__":
    main()
