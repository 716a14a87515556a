"""A small training run that checkpoints with checkflow and resumes exactly.

Random data, dropout and a shuffling data loader all draw from RNGs, so a resumed run is
bitwise equal to an uninterrupted one only when parameters, optimizer, scheduler, loader
position and RNG states all come back exactly.

    python examples/train.py --dir runs/demo --steps 200 --every 10 --out final.pt

With a coordinator, the token comes from ``--token-file PATH`` or ``CHECKFLOW_TOKEN`` (an
argument beats the variable, as for every setting; see the README's "Settings"):

    CHECKFLOW_TOKEN=T python examples/train.py --dir runs/demo --coordinator URL --job demo
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import torch
from torch import nn

from checkflow import Checkpointer
from checkflow.cli.coordinator import read_token_file
from checkflow.cli.output import TOKEN_ON_COMMAND_LINE, CliError, warning


class ShuffledData:
    """A resumable loader over a fixed synthetic data set: a new permutation every epoch."""

    def __init__(self, n: int = 4096, dim: int = 32, batch: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x[:, :4].sum(dim=1, keepdim=True) > 0).float()
        self.batch, self.seed, self.epoch, self.pos = batch, seed, 0, 0

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(len(self.x), generator=g)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self.x):
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def build(
    dim: int = 32, hidden: int = 256, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(dim, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return model, opt, sched


def _report_commit(future: object) -> None:
    if not future.exception():  # type: ignore[attr-defined]
        print(f"committed {future.result()}", flush=True)  # type: ignore[attr-defined]


def train(args: argparse.Namespace) -> dict[str, object]:
    if args.device.startswith("cuda"):
        # Bitwise equal runs on a GPU need deterministic kernels; cuBLAS reads this
        # variable when it first starts, so it is set before any CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    model, opt, sched = build(device=args.device)
    data = ShuffledData()
    state = {"model": model, "optim": opt, "sched": sched, "data": data}
    every: int | str = "auto" if args.every == "auto" else int(args.every)
    with Checkpointer(
        args.dir,
        state,
        every=every,
        codec=args.codec,
        keep=args.keep,
        coordinator=args.coordinator,
        job=args.job,
        token=args.token,
        max_overhead=args.max_overhead,
    ) as ckpt:
        start = ckpt.restore()
        print(f"start step {start}", flush=True)
        for step in range(start, args.steps):
            x, y = (t.to(args.device) for t in data.next())
            noise = 0.01 * torch.randn_like(x)  # draws from the global (or the CUDA) RNG
            loss = nn.functional.binary_cross_entropy_with_logits(model(x + noise), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            future = ckpt.step()
            if future is not None:
                future.add_done_callback(_report_commit)
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
            if args.kill_at is not None and step + 1 == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # an injected failure, mid-persist or not
    final = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "data": data.state_dict(),
        "loss": loss.item(),
    }
    if args.out:
        torch.save(final, args.out)
    print(
        f"done {args.steps} steps; checkpoints {ckpt.stats.committed} of "
        f"{ckpt.stats.due} due, waits {ckpt.stats.waits} ({ckpt.stats.waited_s:.2f}s), "
        f"interval {ckpt.stats.interval}",
        flush=True,
    )
    return final


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="checkpoint URI (path or fsspec URL)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", default="10", help="steps between checkpoints, or 'auto'")
    p.add_argument("--codec", default="exact")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--max-overhead", type=float, default=0.035)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after step N")
    p.add_argument("--out", default=None, help="write the final state here (torch.save)")
    p.add_argument("--coordinator", default=None)
    p.add_argument("--job", default=None)
    p.add_argument("--token-file", default=None, help="read the coordinator's token from PATH")
    p.add_argument("--token", default=None, help="deprecated: use --token-file or CHECKFLOW_TOKEN")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: train on the GPU")
    args = p.parse_args(argv)
    if args.token is not None:
        warning(TOKEN_ON_COMMAND_LINE)
    elif args.token_file is not None:
        try:
            args.token = read_token_file(args.token_file)
        except CliError as e:
            p.error(str(e))
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    train(parse())
