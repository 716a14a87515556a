"""One rank of a 2-rank gloo job for tests/runtime/test_hang_detection.py (a plain process:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment).

It trains ``--steps`` DDP steps under a ``Checkpointer`` with a coordinator, prints
``trained <rank> <step>``, then:

- ``--mode stuck``: rank 1 spins in a Python loop (its heartbeat thread still runs) while
  rank 0 blocks in an ``all_reduce`` that rank 1 never joins; they print ``stuck <rank>``.
  Only the coordinator's abort can end them (exit 75).
- ``--mode paused``: rank 0 sleeps ``--pause`` seconds inside ``ckpt.paused()`` while rank 1
  waits for it in an ``all_reduce``, not paused; then both train ``--steps`` more steps,
  close the Checkpointer (the coordinator hears they finished) and print ``done <rank>``.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from checkflow import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--mode", choices=["stuck", "paused"], required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--pause", type=float, default=0.0)
    args = p.parse_args()
    # gloo's own collective timeout stays far away: only the coordinator ends a hang here.
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = Checkpointer(
        args.dir,
        {"model": model, "optim": opt},
        every=1000,
        coordinator=args.url,
        job=args.job,
        token=args.token,
        hang_timeout=args.hang_timeout,
    )

    def train(steps: int) -> None:
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            time.sleep(args.step_time)

    with ckpt:
        ckpt.restore()
        train(args.steps)
        print(f"trained {rank} {ckpt.current_step}", flush=True)
        if args.mode == "stuck":
            print(f"stuck {rank}", flush=True)
            if rank == 1:
                spin = 0
                while True:  # stuck in Python: the GIL is released only at switch intervals
                    spin += 1
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
            raise AssertionError("the all_reduce completed without rank 1")
        if rank == 0:
            with ckpt.paused():
                time.sleep(args.pause)
        dist.all_reduce(torch.ones(1))  # rank 1 waits here for rank 0, not paused
        train(args.steps)
    print(f"done {rank}", flush=True)


if __name__ == "__main__":
    main()
