"""A small training loop under a ``Checkpointer`` with a coordinator list, paced so that a
test can kill a coordinator mid-run: ``python _steady_train.py DIR URLS JOB STEPS PAUSE_S``
(the token in ``CHECKFLOW_TOKEN``). Prints ``step N`` per step, then the longest time one
step took on the training thread (``ckpt.step()`` and the loop body), then ``done``."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from checkflow import Checkpointer


def main(root: str, urls: str, job: str, steps: int, pause_s: float) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    longest = 0.0
    with Checkpointer(root, state, every=5, keep=0, coordinator=urls, job=job) as ckpt:
        for step in range(ckpt.restore(), steps):
            began = time.monotonic()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            longest = max(longest, time.monotonic() - began)
            print(f"step {step + 1}", flush=True)
            time.sleep(pause_s)
    print(f"longest step {longest:.3f}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
