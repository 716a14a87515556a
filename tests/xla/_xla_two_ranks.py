"""One rank of a two-process XLA:CPU job (data parallel: each process its own XLA:CPU
client and device, torch.distributed on gloo for checkflow), from torchrun's environment.

    save:    train 4 steps, checkpoint at 2 and 4, write the CPU state at step 2 to --out
    restore: a fresh model (other weights) restores; print the step and whether the state
             is bitwise the one at step 2 (--out)

Both ranks see the same batches, so their replicas stay equal without a gradient
all-reduce (torch_xla's collectives need a PJRT runtime that spans the processes, which
the CPU one does not). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch_xla
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from checkflow import Checkpointer  # noqa: E402


def build(seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch_xla.device())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def on_cpu(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.cpu() for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        out.update({f"optim.state.{i}.{k}": v.cpu() for k, v in per_param.items()})
    return out


def train_step(model: nn.Module, opt: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
    device = torch_xla.device()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["save", "restore"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(f"{args.out}.rank{rank}")
    report: dict[str, Any] = {"rank": rank}
    if args.phase == "save":
        model, opt = build(seed=0)
        with Checkpointer(args.dir, {"model": model, "optim": opt}, every=2, rng=False) as ckpt:
            for step in range(1, 5):
                train_step(model, opt, step)
                ckpt.step()
                if step == 2:
                    torch.save(on_cpu(model, opt), out)
    else:
        model, opt = build(seed=1)
        with Checkpointer(args.dir, {"model": model, "optim": opt}, rng=False) as ckpt:
            report["restored"] = ckpt.restore()
        expected = torch.load(out)
        got = on_cpu(model, opt)
        report["equal"] = sorted(got) == sorted(expected) and all(
            torch.equal(got[k], expected[k]) for k in expected
        )
        report["device"] = str(next(model.parameters()).device)
    print(json.dumps(report), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads at interpreter exit (see README, Distributed jobs)


if __name__ == "__main__":
    main()
