"""Small in-process training setups for runtime tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def small_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return {"model": model, "optim": opt, "sched": sched}


def train_step(state: dict[str, Any]) -> None:
    model, opt, sched = state["model"], state["optim"], state["sched"]
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
