"""A small DLRM-like recommender (embedding tables + MLP) on synthetic clicks, checkpointed
with incremental codecs: only the embedding rows a step touched change, so deltas are small.

    python examples/dlrm.py --dir runs/dlrm --steps 300 --every 10 --codec q8
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

import torch
from torch import nn

from checkflow import Checkpointer

TABLES, ROWS, DIM, DENSE = 3, 4000, 16, 8


class DLRM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(ROWS, DIM, sparse=True) for _ in range(TABLES))
        self.bottom = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM * (TABLES + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        feats = [self.bottom(dense)] + [e(sparse[:, i]) for i, e in enumerate(self.emb)]
        return self.top(torch.cat(feats, dim=1)).squeeze(1)


class Clicks:
    """Synthetic click log: Zipf-like sparse ids, a hidden ground truth, resumable position."""

    def __init__(self, batch: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.truth = [torch.randn(ROWS, generator=g) for _ in range(TABLES)]
        self.w = torch.randn(DENSE, generator=g)
        self.batch, self.seed, self.pos = batch, seed, 0

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        dense = torch.randn(self.batch, DENSE, generator=g)
        u = torch.rand(self.batch, TABLES, generator=g)
        sparse = (ROWS * u.pow(3)).long().clamp_(max=ROWS - 1)  # a few hot rows, a long tail
        logit = dense @ self.w + sum(self.truth[t][sparse[:, t]] for t in range(TABLES))
        return dense, sparse, (logit > 0).float()

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.pos += 1
        return self.batch_at(self.pos - 1)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = DLRM()
    sparse_params = [p for e in model.emb for p in e.parameters()]
    dense_params = list(model.bottom.parameters()) + list(model.top.parameters())
    return {
        "model": model,
        "sparse_opt": torch.optim.SparseAdam(sparse_params, lr=0.05),
        "dense_opt": torch.optim.Adam(dense_params, lr=0.01),
        "data": Clicks(),
    }


def train_step(state: dict[str, Any]) -> float:
    dense, sparse, y = state["data"].next()
    loss = nn.functional.binary_cross_entropy_with_logits(state["model"](dense, sparse), y)
    loss.backward()
    state["sparse_opt"].step()
    state["dense_opt"].step()
    state["sparse_opt"].zero_grad()
    state["dense_opt"].zero_grad()
    return loss.item()


@torch.no_grad()
def eval_loss(state: dict[str, Any], batches: int = 8) -> float:
    data = Clicks()  # the same ground truth, batches training never sees
    losses = []
    for i in range(batches):
        dense, sparse, y = data.batch_at(10**9 + i)
        logits = state["model"](dense, sparse)
        losses.append(nn.functional.binary_cross_entropy_with_logits(logits, y).item())
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--codec", default="q8", help="a codec name for every tensor")
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    state = build()
    with Checkpointer(
        args.dir, state, every=args.every, codec=args.codec, keep=3, full_every=args.full_every
    ) as ckpt:
        start = ckpt.restore()
        print(f"start step {start}", flush=True)
        for step in range(start, args.steps):
            loss = train_step(state)
            future = ckpt.step()
            if future is not None:
                future.add_done_callback(
                    lambda f: (
                        None if f.exception() else print(f"committed {f.result()}", flush=True)
                    )
                )
            print(f"step {step + 1} loss {loss:.6f}", flush=True)
            if args.kill_at is not None and step + 1 == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    final = {k: v.state_dict() for k, v in state.items()}
    final["eval_loss"] = eval_loss(state)
    if args.out:
        torch.save(final, args.out)
    print(f"done; eval loss {final['eval_loss']:.6f}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    main()
