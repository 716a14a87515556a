"""Helpers to run examples/train.py as a real child process and compare final states."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"


def run_train(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run the example to completion; returns its stdout."""
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def run_until_killed(
    *args: str, kill_after_line: str, env: dict[str, str] | None = None, timeout: float = 120
) -> list[str]:
    """Start the example and SIGKILL it as soon as it prints ``kill_after_line``."""
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    seen: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line.strip())
            if line.strip().startswith(kill_after_line):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=timeout)
    assert proc.returncode == -signal.SIGKILL, f"child ended on its own: {seen[-3:]}"
    return seen


def load_final(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        ), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {a.keys()} != {b.keys()}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
