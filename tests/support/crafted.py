"""Crafted checkpoints made by the adversarial tests: a small real run to tamper with, and
the CLI run as a user runs it, with what its one-line error says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from checkflow import Checkpointer

STEPS = 3
W = "model.weight"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``checkflow ARGS`` in a child process; the timeout turns a hang into a failure."""
    return subprocess.run(
        [sys.executable, "-m", "checkflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """The CLI's error: one line on stderr (beside the catalog's warnings about damaged
    steps it skipped), no traceback."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip() and "WARNING" not in x]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("checkflow: error: "), lines[0]
    return lines[0].removeprefix("checkflow: error: ")


def model_state() -> dict[str, Any]:
    """A fresh, seeded model whose weight is a 64-row tensor (two halves of 32 rows)."""
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 64)}  # weight: a 64-row tensor


def write_steps(root: Path, codec: str = "exact") -> list[dict[str, torch.Tensor]]:
    """``STEPS`` committed steps; returns each step's model state, oldest first."""
    state = model_state()
    saved = []
    with Checkpointer(str(root), state, every=1, keep=0, codec=codec) as ck:
        for _ in range(STEPS):
            with torch.no_grad():
                state["model"].weight.add_(1.0)
            future = ck.step()
            assert future is not None
            future.result()
            saved.append({k: v.clone() for k, v in state["model"].state_dict().items()})
    return saved
