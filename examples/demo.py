"""The main job: train, checkpoint, survive a SIGKILL, resume, and prove the result is exact.

1. starts a checkflow coordinator in this process (uvicorn on 127.0.0.1, a free port);
2. runs examples/train.py uninterrupted to get the reference final state;
3. runs it again against the coordinator, SIGKILLs it mid-run (mid-persist or not);
4. resumes it from the newest committed checkpoint (the coordinator's restore point);
5. compares the final parameters, optimizer, scheduler, loader and loss bit for bit.

    python examples/demo.py [--steps 300] [--kill-at 170] [--dir runs/demo]

Exit code 0 when the resumed run is bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(db: Path) -> tuple[str, Any]:
    """A real uvicorn server in a thread of this process."""
    import uvicorn
    from checkflow_server.app import create_app
    from checkflow_server.settings import Settings

    port = free_port()
    app = create_app(Settings(host="127.0.0.1", port=port, db=db, log_level="warning"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("coordinator did not start within 20 s")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def train_cmd(ckpt: str, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(TRAIN),
        "--dir",
        ckpt,
        "--steps",
        str(steps),
        "--every",
        "10",
        *extra,
    ]


def run_killed(cmd: list[str], kill_at: int) -> int:
    """Run ``cmd`` and SIGKILL it right after it reports step ``kill_at``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"step {kill_at} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    return proc.returncode


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def main() -> int:
    p = argparse.ArgumentParser(description="checkflow: kill a training run and resume it exactly")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=173)
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = p.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="checkflow-demo-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    url, server = start_coordinator(work / "coordinator.db")
    print(f"coordinator: {url} (in-process)")
    coord = ["--coordinator", url, "--job", "demo"]

    t0 = time.perf_counter()
    subprocess.run(
        train_cmd(str(work / "reference"), args.steps, "--out", str(work / "ref.pt")),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"1. uninterrupted run: {args.steps} steps ({time.perf_counter() - t0:.1f} s)")

    code = run_killed(train_cmd(str(work / "ckpt"), args.steps, *coord), args.kill_at)
    print(f"2. second run SIGKILLed after step {args.kill_at} (exit {code})")
    subprocess.run([sys.executable, "-m", "checkflow.cli", "ls", str(work / "ckpt")], check=False)

    out = subprocess.run(
        train_cmd(str(work / "ckpt"), args.steps, *coord, "--out", str(work / "resumed.pt")),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    print(f"3. resumed: {out[0]}; {out[-1]}")
    server.should_exit = True

    ref = torch.load(work / "ref.pt", weights_only=False)
    resumed = torch.load(work / "resumed.pt", weights_only=False)
    if equal(ref, resumed):
        print(
            f"4. finished: final loss {resumed['loss']:.6f}; parameters, optimizer, scheduler "
            "and data position are bitwise equal to the uninterrupted run"
        )
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"4. MISMATCH: the resumed run differs from the uninterrupted one (kept {work})")
    return 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
