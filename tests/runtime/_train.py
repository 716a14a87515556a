"""Helpers to run examples/train.py as a real child process and compare final states."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
DLRM = ROOT / "examples" / "dlrm.py"


def run_train(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, script: Path = TRAIN
) -> str:
    """Run an example to completion; returns its stdout."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def run_until_killed(
    *args: str,
    kill_after_step: int,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    require_commit: bool = True,
    wait_for: Path | None = None,
    script: Path = TRAIN,
    kill_when: Callable[[], bool] | None = None,
) -> int:
    """Start the example and SIGKILL it after step ``kill_after_step`` (or the first step
    after it once a checkpoint has committed, with ``require_commit``), once ``wait_for``
    exists when given and ``kill_when()`` holds. Returns the step it was killed after."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    seen: list[str] = []
    committed = not require_commit
    killed_after = -1
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line.strip())
            committed = committed or line.startswith("committed ")
            if line.startswith("step ") and committed:
                step = int(line.split()[1])
                if step >= kill_after_step and (kill_when is None or kill_when()):
                    deadline = time.monotonic() + 30
                    while wait_for is not None and not wait_for.exists():
                        assert time.monotonic() < deadline, f"{wait_for} never appeared"
                        time.sleep(0.01)
                    proc.send_signal(signal.SIGKILL)
                    killed_after = step
                    break
    finally:
        proc.kill()
        proc.wait(timeout=timeout)
    assert proc.returncode == -signal.SIGKILL, f"child ended on its own: {seen[-3:]}"
    return killed_after


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
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
