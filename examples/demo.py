"""The main job: train, checkpoint, survive a SIGKILL, resume, and prove the result is exact.

1. starts a checkflow coordinator in this process (uvicorn on 127.0.0.1, a free port);
2. runs examples/train.py uninterrupted to get the reference final state;
3. runs it again against the coordinator; that run kills itself with SIGKILL right after
   step ``--kill-at`` (``train.py --kill-at``: deterministic, mid-persist or not);
4. resumes it from the newest committed checkpoint (the coordinator's restore point);
5. compares the final parameters, optimizer, scheduler, loader and loss bit for bit.

    python examples/demo.py [--steps 300] [--kill-at 173] [--dir runs/demo]

Its last line says where the checkpoints are: ``--dir DIR`` keeps them in ``DIR/ckpt``
(``checkflow ls DIR/ckpt``); without it they are deleted with the temporary work folder.
A ``--dir`` that holds anything the demo does not write is refused (exit 2), never emptied.

Exit code 0 when the resumed run is bitwise equal to the uninterrupted one. Exit code 1,
with the reason, when it is not, or when the demo did not show what it claims: the second
run must die of SIGKILL at the kill step, and the resume must start from a checkpoint
below it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"


@contextlib.contextmanager
def coordinator(db: Path) -> Iterator[str]:
    """A real uvicorn server in a thread of this process; its URL.

    It listens on a port the OS picks at bind time (no free-port race), and is stopped and
    joined on the way out: a server thread still running while the interpreter shuts down
    can crash it (a segmentation fault after the demo had passed).
    """
    import uvicorn
    from checkflow_server.app import create_app
    from checkflow_server.settings import Settings

    app = create_app(Settings(host="127.0.0.1", port=0, db=db, log_level="warning"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="coordinator", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process coordinator did not start within 20 s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


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


DEMO_FILES = frozenset(
    {"reference", "ckpt", "ref.pt", "resumed.pt", "reference.log", "killed.log", "resumed.log"}
)
"""What the demo writes in its work folder, besides ``coordinator.db`` and its journals."""


def foreign_files(work: Path) -> list[str]:
    """The names in ``work`` the demo did not write: a ``--dir`` holding any is refused, so a
    mistyped ``--dir`` never deletes someone's files (an earlier demo's are replaced)."""
    if not work.is_dir():
        return [work.name] if work.exists() else []
    names = sorted(p.name for p in work.iterdir())
    return [n for n in names if n not in DEMO_FILES and not n.startswith("coordinator.db")]


def where_checkpoints(ckpt: Path, kept: bool) -> str:
    """The demo's last line: where its checkpoints are, or that they went with the folder."""
    if kept:
        return f"5. checkpoints kept in {ckpt}: checkflow ls {ckpt}"
    return f"5. checkpoints were in {ckpt}, deleted with the work folder (--dir DIR keeps them)"


class DemoFailed(Exception):
    """The demo did not show what it claims; the message says what happened instead."""


def run(cmd: list[str], what: str, log: Path) -> list[str]:
    """Run a training process to completion; its stdout lines. Its stderr goes to ``log``."""
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode != 0:
        raise DemoFailed(f"the {what} exited with code {proc.returncode}{tail(log)}")
    return proc.stdout.splitlines()


def run_killed(cmd: list[str], kill_at: int, log: Path) -> tuple[int, int]:
    """Run ``cmd`` with ``--kill-at``; check it died of SIGKILL right after ``kill_at``.

    The child kills itself: a kill sent from here after reading "step N" could land
    after the child had already finished, and the demo would prove nothing.

    Returns:
        The last step the child reported (``kill_at``) and its exit code (-9).
    """
    with open(log, "w") as err:
        proc = subprocess.run(
            [*cmd, "--kill-at", str(kill_at)], stdout=subprocess.PIPE, stderr=err, text=True
        )
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    last = steps[-1] if steps else 0
    if proc.returncode != -signal.SIGKILL:
        raise DemoFailed(
            f"the second run was to die of SIGKILL after step {kill_at}, but it exited with "
            f"code {proc.returncode} after step {last}{tail(log)}"
        )
    if last != kill_at:
        raise DemoFailed(f"the second run was SIGKILLed after step {last}, not {kill_at}")
    return last, proc.returncode


def tail(log: Path, lines: int = 20) -> str:
    """The end of a child's stderr, to show with a failure."""
    text = log.read_text().splitlines()[-lines:]
    return f"; the end of {log}:\n" + "\n".join(text) if text else f" (nothing in {log})"


def resumed_from(lines: list[str], kill_at: int) -> int:
    """The step the resumed run started from (its first line, "start step N").

    Raises:
        DemoFailed: it is not a restored checkpoint below the kill step: starting at 0
            restored nothing, and at or past ``kill_at`` would mean the killed run was not
            cut short where the demo says.
    """
    first = lines[0] if lines else ""
    if not first.startswith("start step "):
        raise DemoFailed(f"the resumed run did not report its start step (first line {first!r})")
    start = int(first.split()[2])
    if not 0 < start < kill_at:
        raise DemoFailed(
            f"the resume was to start from a checkpoint below step {kill_at}, "
            f"but it started at step {start}"
        )
    return start


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
    if not 10 < args.kill_at < args.steps:
        p.error(f"--kill-at must be above 10 (the first checkpoint) and below --steps {args.steps}")
    if args.dir is not None and (foreign := foreign_files(Path(args.dir))):
        p.error(
            f"--dir {args.dir} holds files the demo did not write ({', '.join(foreign[:5])}); "
            "choose a new or empty folder"
        )
    work = Path(args.dir or tempfile.mkdtemp(prefix="checkflow-demo-"))
    shutil.rmtree(work, ignore_errors=True)  # an earlier demo's files only (foreign_files)
    work.mkdir(parents=True)

    try:
        with coordinator(work / "coordinator.db") as url:
            print(f"coordinator: {url} (in-process)")
            same = demo(work, args.steps, args.kill_at, ["--coordinator", url, "--job", "demo"])
    except DemoFailed as e:
        print(f"demo FAILED: {e} (work folder kept: {work})", file=sys.stderr)
        return 1
    if not same:
        print(f"4. MISMATCH: the resumed run differs from the uninterrupted one (kept {work})")
        return 1
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(where_checkpoints(work / "ckpt", kept=args.dir is not None))
    return 0


def demo(work: Path, steps: int, kill_at: int, coord: list[str]) -> bool:
    """Steps 1-4 of the module docstring; whether the resumed run is bitwise equal."""
    t0 = time.perf_counter()
    reference = train_cmd(str(work / "reference"), steps, "--out", str(work / "ref.pt"))
    run(reference, "reference run", work / "reference.log")
    print(f"1. uninterrupted run: {steps} steps ({time.perf_counter() - t0:.1f} s)")

    killed, code = run_killed(
        train_cmd(str(work / "ckpt"), steps, *coord), kill_at, work / "killed.log"
    )
    print(
        f"2. second run killed itself with SIGKILL after step {killed} (exit {code}); "
        f"committed in {work / 'ckpt'}:",
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "checkflow.cli", "ls", str(work / "ckpt")], check=False)

    out = run(
        train_cmd(str(work / "ckpt"), steps, *coord, "--out", str(work / "resumed.pt")),
        "resumed run",
        work / "resumed.log",
    )
    start = resumed_from(out, kill_at)
    print(f"3. resumed from step {start} (below the kill at {kill_at}); {out[-1]}")

    ref = torch.load(work / "ref.pt", weights_only=False)
    resumed = torch.load(work / "resumed.pt", weights_only=False)
    if not equal(ref, resumed):
        return False
    print(
        f"4. finished: final loss {resumed['loss']:.6f}; parameters, optimizer, scheduler "
        "and data position are bitwise equal to the uninterrupted run"
    )
    return True


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
