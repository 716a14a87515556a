"""Start real gloo ranks as child processes (torchrun's environment), kill them, collect output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    world: int,
    config: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    expect_killed: bool = False,
) -> list[str]:
    """Run ``_worker.py`` on ``world`` ranks with ``config``; returns each rank's stdout.

    When a rank dies (the worker kills itself with SIGKILL where ``config`` says), the
    others are killed too, as torchrun would do, and ``expect_killed`` must be True.
    """
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(config)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=rank_env,
            )
        )
    deadline = time.monotonic() + timeout
    killed = False
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode == -signal.SIGKILL for p in procs if p.poll() is not None):
                killed = True
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            if any(p.returncode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout}s")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate() for p in procs]
    codes = [p.returncode for p in procs]
    if expect_killed:
        assert killed or -signal.SIGKILL in codes, f"no rank was killed: {codes}"
    else:
        failures = [
            f"rank {r} exit {c}:\n{outputs[r][1][-3000:]}" for r, c in enumerate(codes) if c
        ]
        assert not failures, "\n".join(failures)
    return [out for out, _ in outputs]
