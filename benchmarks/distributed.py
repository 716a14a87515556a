"""Save and restore a sharded FSDP2 state: checkflow vs torch.distributed.checkpoint (DCP).

Runs, for each world size, real gloo ranks on this machine (CPU) holding an FSDP2 model of
``--size-mib`` of fp32 parameters, and measures in the same run:

- save wall time (call until every rank finished; checkflow: until committed),
- training stall per checkpoint (time the training thread was blocked: checkflow's
  ``save()`` plus the wait in the next ``optimizer.step``; ``dcp.async_save`` until it
  returns plus waiting for the staging; ``dcp.save`` all of it),
- bytes written per rank (max over ranks),
- restore wall time (checkflow ``restore()`` vs ``dcp.load`` into the same FSDP2 model),
  both strategies' files dropped from the page cache first.

Medians over ``--repeats`` (each repeat runs checkflow, then DCP: interleaved); ratios
are checkflow / DCP, the save ratio with the spread of its per-repeat pairs. Usage::

    .venv/bin/python benchmarks/distributed.py --size-mib 64 --worlds 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYER = 1024  # rows and columns of each Linear: 4 MiB of fp32 weights per layer


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import evict  # noqa: E402  (benchmarks/ is not a package)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- one rank ------------------------------------------------------------------------------
def _build(size_mib: int, world: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, size_mib * (1 << 20) // (LAYER * LAYER * 4))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # each rank allocates only its shards
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


def _dir_bytes(path: Path, rank: int, pattern: str) -> int:
    return sum(f.stat().st_size for f in path.rglob(pattern.format(rank=rank)))


def _rank_main(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from checkflow import Checkpointer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = _build(cfg["size_mib"], world)
    root = Path(cfg["root"])
    results: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    def barrier_max(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def dcp_state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    def train_step() -> None:
        # A forward and backward pass: the window a background snapshot copy overlaps.
        model(torch.ones(4, LAYER)).sum().backward()

    async_group = dist.new_group(backend="gloo")
    uri = root / "checkflow"
    # The optimizer is part of the state: its step hook is what lets the weight copy run
    # in the background (the weights cannot change before that step).
    state = {"model": model, "optim": opt}
    ckpt = Checkpointer(str(uri), state, every=10**9, rng=False, keep=1)
    ckpt.open()
    for i in range(cfg["repeats"] + 1):  # the first round warms up (allocates buffers)
        # checkflow, as a plain save: until every rank's part is stored and committed.
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save().result()
        dist.barrier()
        save_s = barrier_max(time.perf_counter() - t0)
        step_dir = uri / f"step-{ckpt.current_step:09d}"
        nbytes = _dir_bytes(step_dir, rank, "rank-{rank:05d}-*.chunks")
        ckpt.step()
        # checkflow inside training: save() returns once the snapshot started; the next
        # optimizer step waits for whatever of the weight copy is left (part of the stall).
        dist.barrier()
        future = ckpt.save()
        train_step()
        opt.step()
        stall = ckpt.stats.stalls_s[-1]
        future.result()
        ckpt.step()

        path = root / f"dcp-{i}"
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(dcp_state(), checkpoint_id=str(path))
        dist.barrier()
        dcp_save_s = barrier_max(time.perf_counter() - t0)

        apath = root / f"dcp-async-{i}"
        dist.barrier()
        t0 = time.perf_counter()
        afuture = dcp.async_save(
            dcp_state(),
            checkpoint_id=str(apath),
            process_group=async_group,  # DCP's advice: not the training group
        )
        astall = time.perf_counter() - t0
        train_step()
        opt.step()
        afuture.result()
        dist.barrier()
        async_s = barrier_max(time.perf_counter() - t0)

        # Both restores read from the disk, as on a restarted node: checkflow wrote with
        # O_DIRECT (nothing cached), dcp.save through the page cache.
        if rank == 0:
            evict(str(uri))
            evict(str(path))
        dist.barrier()
        t0 = time.perf_counter()
        with Checkpointer(str(uri), state, every=10**9, rng=False) as reader:
            reader.restore()
        dist.barrier()
        restore_s = barrier_max(time.perf_counter() - t0)

        dist.barrier()
        t0 = time.perf_counter()
        sd = dcp_state()
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        dist.barrier()
        dcp_restore_s = barrier_max(time.perf_counter() - t0)
        if i:
            record("checkflow_save_s", save_s)
            record("checkflow_stall_s", barrier_max(stall))
            record("checkflow_bytes", barrier_max(nbytes))
            record("dcp_save_s", dcp_save_s)
            record("dcp_bytes", barrier_max(_dir_bytes(path, rank, "__{rank}_*.distcp")))
            record("dcp_async_save_s", async_s)
            record("dcp_async_stall_s", barrier_max(astall))
            record("checkflow_restore_s", restore_s)
            record("dcp_restore_s", dcp_restore_s)
        if rank == 0:
            for p in (path, apath):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    ckpt.close()
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------
def _run_world(world: int, size_mib: int, repeats: int) -> dict[str, list[float]]:
    root = Path(tempfile.mkdtemp(prefix=f"cf-bench-{world}-"))
    port = _free_port()
    cfg = json.dumps({"size_mib": size_mib, "repeats": repeats, "root": str(root)})
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank-config", cfg],
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
        )
    outs = [p.communicate()[0] for p in procs]
    shutil.rmtree(root, ignore_errors=True)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"world {world}: ranks exited {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        _rank_main(json.loads(args.rank_config))
        # gloo's worker threads outlive destroy_process_group (FSDP2 holds the group) and
        # can abort the rank during interpreter finalization (pytorch/pytorch#38228): the
        # results are printed, so leave without finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    med = statistics.median
    print(f"FSDP2 state of {args.size_mib} MiB fp32, CPU/gloo, median of {args.repeats}")
    header = (
        "world | save cf / dcp / async (s) | save ratio [pairs] | stall cf / async (s)"
        " | stall ratio | restore cf / dcp (s) | restore ratio | MiB/rank cf / dcp"
    )
    print(header)
    print("-" * len(header))
    for world in (int(w) for w in args.worlds.split(",")):
        r = _run_world(world, args.size_mib, args.repeats)
        m = {k: med(v) for k, v in r.items()}
        pairs = [c / d for c, d in zip(r["checkflow_save_s"], r["dcp_save_s"], strict=True)]
        print(
            f"{world:5d} | {m['checkflow_save_s']:.3f} / {m['dcp_save_s']:.3f} / "
            f"{m['dcp_async_save_s']:.3f} | {m['checkflow_save_s'] / m['dcp_save_s']:.2f}x "
            f"[{min(pairs):.2f}..{max(pairs):.2f}] | "
            f"{m['checkflow_stall_s']:.4f} / {m['dcp_async_stall_s']:.4f} | "
            f"{m['checkflow_stall_s'] / m['dcp_async_stall_s']:.3f}x | "
            f"{m['checkflow_restore_s']:.3f} / {m['dcp_restore_s']:.3f} | "
            f"{m['checkflow_restore_s'] / m['dcp_restore_s']:.2f}x | "
            f"{m['checkflow_bytes'] / 2**20:.1f} / {m['dcp_bytes'] / 2**20:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
