"""A 2-rank gloo DDP job for ``checkflow run``: trains, checkpoints every 5 steps, resumes.

In the first round (``TORCHELASTIC_RESTART_COUNT=0``) rank 1 SIGKILLs itself after step
``--kill-at``, once the checkpoint before it has committed. Lines it appends to
``<--events>/rank-<rank>.log`` (not stdout, where the ranks' lines can interleave):
``env <rank> <round> <coordinator> <job>``, ``start <rank> <round> <step>``,
``fault <time>``, ``step <rank> <round> <step> <time>``, ``final <rank> <digest>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from checkflow import Checkpointer
from checkflow.catalog import committed_steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=13)
    p.add_argument("--events", required=True, help="folder of the per-rank event logs")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    log = open(os.path.join(args.events, f"rank-{rank}.log"), "a", buffering=1)  # noqa: SIM115

    def print(line: str, flush: bool = True) -> None:  # noqa: A001 - one line per event
        log.write(line + "\n")

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    coordinator = os.environ.get("CHECKFLOW_COORDINATOR", "-")
    print(f"env {rank} {restart} {coordinator} {os.environ.get('CHECKFLOW_JOB', '-')}", flush=True)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with Checkpointer(args.dir, {"model": model, "optim": opt}, every=5, keep=0) as ckpt:
        start = ckpt.restore()
        print(f"start {rank} {restart} {start}", flush=True)
        for step in range(start, args.steps):
            data = torch.Generator().manual_seed(step * 2 + rank)
            x = torch.randn(8, 16, generator=data)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            print(f"step {rank} {restart} {step + 1} {time.time():.3f}", flush=True)
            if restart == 0 and rank == 1 and step + 1 >= args.kill_at:
                # The fault comes once the newest checkpoint has committed on every rank (this
                # rank's part is not enough: rank 0 may still be persisting), so the restart
                # must resume from it.
                ckpt.wait()
                newest = args.kill_at // 5 * 5
                deadline = time.monotonic() + 20
                while max(committed_steps(ckpt.storage), default=0) < newest:
                    assert time.monotonic() < deadline, f"step {newest} never committed"
                    time.sleep(0.05)
                print(f"fault {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    weights = b"".join(t.detach().numpy().tobytes() for t in model.parameters())
    print(f"final {rank} {hashlib.sha1(weights).hexdigest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
