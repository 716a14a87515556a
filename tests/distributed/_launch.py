"""Start real gloo ranks as child processes (torchrun's environment), kill them, collect output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")


def job_store() -> TCPStore:
    """The c10d store of one job, hosted by this process as torchrun's agent hosts it.

    The OS picks its port while binding it, so no other process can take the port between
    choosing and binding it; and every job starts from an empty store, never with keys that
    a killed job left behind. It outlives the ranks, so a test can read what they left.
    """
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def run_ranks(
    world: int,
    config: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    expect_killed: bool = False,
    store: TCPStore | None = None,
) -> list[str]:
    """Run ``_worker.py`` on ``world`` ranks with ``config``; returns each rank's stdout.

    When a rank dies (the worker kills itself with SIGKILL where ``config`` says), the
    others are killed too, as torchrun would do, and ``expect_killed`` must be True.
    The ranks use ``store`` (a fresh ``job_store()`` by default) as their c10d store.
    """
    if store is None:
        store = job_store()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
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
