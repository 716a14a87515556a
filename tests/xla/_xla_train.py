"""A small training run on an XLA device (torch_xla's CPU backend in tests) with checkflow.

Dropout draws from the XLA device's RNG, and each step's batch comes from a CPU generator
seeded by the step, so a resumed run is bitwise equal to an uninterrupted one only when
parameters, optimizer state and the XLA RNG seed all come back exactly.

    PJRT_DEVICE=CPU python tests/xla/_xla_train.py --dir runs/x --steps 12 --every 3 --out f.pt
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/xla/_xla_train.py --mesh 2,2 ...   # SPMD
    checkflow run --nproc-per-node=1 ... tests/xla/_xla_train.py --kill-at 7 ...     # launcher

With ``--kill-at N``, the first round under ``checkflow run`` (torchelastic's restart count
0) waits for its checkpoints to commit after step N and SIGKILLs itself; the launcher's
next round resumes.

With ``--mesh``, every weight is sharded with ``mark_sharding`` over a mesh of that shape
(dim 0 over the first axis, dim 1 over the second when there is one); biases over the
first axis only, so along a 2-D mesh they are partially replicated.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from checkflow import Checkpointer  # noqa: E402

DIM, HIDDEN = 16, 64


def build(device: Any, mesh_shape: tuple[int, ...] | None) -> tuple[nn.Module, Any]:
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 8),
    ).to(device)
    if mesh_shape is not None:
        shard(model, mesh_shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def shard(model: nn.Module, mesh_shape: tuple[int, ...]) -> None:
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    axes = ("x", "y")[: len(mesh_shape)]
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), mesh_shape, axes)
    for p in model.parameters():
        spec = ("x", "y" if len(axes) == 2 else None)[: p.dim()]
        xs.mark_sharding(p, mesh, spec)


def batch(step: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, DIM, generator=g).to(device), torch.randn(32, 8, generator=g).to(device)


def final_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    import torch_xla.core.xla_model as xm

    def cpu(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cpu()
        if isinstance(v, dict):
            return {k: cpu(x) for k, x in v.items()}
        return v

    return {
        "model": cpu(model.state_dict()),
        "optim": cpu(opt.state_dict()),
        "xla_rng": int(xm.get_rng_state()),
    }


def first_round() -> bool:
    """True outside a launcher and in a launcher's first round of workers."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--codec", default="exact")
    p.add_argument("--mesh", default=None, help="SPMD mesh shape, e.g. 4 or 2,2")
    p.add_argument("--out", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle after each step")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL after this step, round 0")
    args = p.parse_args(argv)

    import torch_xla

    mesh_shape = tuple(int(n) for n in args.mesh.split(",")) if args.mesh else None
    if mesh_shape is not None:
        import torch_xla.runtime as xr

        xr.use_spmd()
    device = torch_xla.device()
    model, opt = build(device, mesh_shape)
    with Checkpointer(
        args.dir, {"model": model, "optim": opt}, every=args.every, codec=args.codec, keep=0
    ) as ckpt:
        start = ckpt.restore()
        print(f"restored {start}", flush=True)
        for step in range(start, args.steps):
            x, y = batch(step, device)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch_xla.sync()
            future = ckpt.step()
            if future is not None:
                future.add_done_callback(
                    lambda f: (
                        print(f"committed {f.result()}", flush=True) if not f.exception() else None
                    )
                )
            print(f"step {ckpt.current_step}", flush=True)
            time.sleep(args.step_sleep)  # a run to kill: leave its persists time to commit
            if ckpt.current_step == args.kill_at and first_round():
                ckpt.wait()
                print(f"killing myself after step {args.kill_at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
    if args.out:
        torch.save(final_state(model, opt), args.out)


if __name__ == "__main__":
    main()
