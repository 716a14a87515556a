"""Sharded data-parallel training (FSDP2 ``fully_shard`` on gloo, CPU) with checkflow.

Run it under ``checkflow run`` (or torchrun), which starts one process per rank:

    checkflow run --nproc-per-node=2 examples/train_fsdp.py --dir runs/fsdp --steps 200

With a coordinator (the token from ``--token-file PATH`` or ``CHECKFLOW_TOKEN``; an
argument beats the variable, as for every setting; see the README's "Settings"):

    checkflow run --nproc-per-node=2 --coordinator URL --job fsdp \\
        examples/train_fsdp.py --dir runs/fsdp --token-file token.txt

Each rank holds one shard of every parameter and of its optimizer state (DTensors on a
one-dimensional CPU mesh) and writes only that shard; a restore reads back the chunks
that overlap each rank's shards, on this world size or another. Options as in
``examples/train_ddp.py``; ``--out`` gathers the full tensors (every rank takes part) and
rank 0 writes them.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
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


def full(value: object) -> object:
    """``value`` with every DTensor gathered whole (a collective: every rank calls it)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    return value


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # rank and world size from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # each layer's parameters gathered when it runs
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    dataset = data()
    sampler = ResumableSampler(len(dataset), seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
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
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            if rank == 0 and (step + 1) % 50 == 0:
                print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
            first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if step + 1 == args.kill_at and rank == world - 1 and first_round:
                os.kill(os.getpid(), signal.SIGKILL)  # an injected failure
    if args.out:
        whole = {"model": full(dict(model.state_dict())), "optim": full(opt.state_dict())}
        if rank == 0:
            torch.save(whole, args.out)
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
