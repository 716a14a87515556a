"""Data-parallel training (DDP on gloo, CPU) that checkpoints with checkflow and resumes exactly.

Run it under ``checkflow run`` (or torchrun), which starts one process per rank:

    checkflow run --nproc-per-node=2 examples/train_ddp.py --dir runs/ddp --steps 200

With a coordinator (the token from ``--token-file PATH`` or ``CHECKFLOW_TOKEN``; an
argument beats the variable, as for every setting; see the README's "Settings"):

    checkflow run --nproc-per-node=2 --coordinator URL --job ddp \\
        examples/train_ddp.py --dir runs/ddp --token-file token.txt

Every rank trains on its own share of each batch (``checkflow.data.ResumableSampler``), so
the checkpoint holds the model and optimizer once (written by ranks balanced by bytes) and
each rank's data position and RNG states. ``--kill-at N`` SIGKILLs the last rank after
step N in the launcher's first round: ``checkflow run`` restarts both ranks, they resume
from the newest committed checkpoint and end bitwise equal to a run that was never killed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from checkflow import Checkpointer
from checkflow.cli.coordinator import read_token_file
from checkflow.cli.output import TOKEN_ON_COMMAND_LINE, CliError, warning
from checkflow.data import ResumableSampler


def data(n: int = 2048, dim: int = 32) -> TensorDataset:
    """A fixed synthetic data set, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x[:, :4].sum(dim=1, keepdim=True) > 0).float())


def batches(loader: DataLoader, sampler: ResumableSampler):  # noqa: ANN201 - a generator
    """This rank's batches, epoch after epoch; the sampler's position is checkpointed."""
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # rank and world size from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    dataset = data()
    sampler = ResumableSampler(len(dataset), seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    # The inner model: DDP's own state_dict would prefix every name with "module.".
    state = {"model": model, "optim": opt, "data": sampler}
    with Checkpointer(
        args.dir,
        state,
        every="auto" if args.every == "auto" else int(args.every),
        keep=args.keep,
        coordinator=args.coordinator,
        job=args.job,
        token=args.token,
    ) as ckpt:
        start = ckpt.restore()
        print(f"rank {rank}: start step {start}", flush=True)
        stream = batches(loader, sampler)
        for step in range(start, args.steps):
            x, y = next(stream)
            loss = nn.functional.binary_cross_entropy_with_logits(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            if rank == 0 and (step + 1) % 50 == 0:
                print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
            first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if step + 1 == args.kill_at and rank == world - 1 and first_round:
                os.kill(os.getpid(), signal.SIGKILL)  # an injected failure
    if args.out and rank == 0:  # every rank holds the same replica
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, args.out)
    print(f"rank {rank}: done {args.steps} steps; {ckpt.stats.committed} checkpoints", flush=True)
    dist.destroy_process_group()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="checkpoint URI (path or fsspec URL)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", default="10", help="steps between checkpoints, or 'auto'")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL the last rank after step N")
    p.add_argument("--out", default=None, help="rank 0 writes the final state here (torch.save)")
    p.add_argument("--coordinator", default=None)
    p.add_argument("--job", default=None)
    p.add_argument("--token-file", default=None, help="read the coordinator's token from PATH")
    p.add_argument("--token", default=None, help="deprecated: use --token-file or CHECKFLOW_TOKEN")
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
