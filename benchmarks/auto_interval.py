"""``every="auto"`` with a coordinator: overhead and the interval shown (issue 32).

A real ``checkflow serve`` on 127.0.0.1 and a real ``Checkpointer`` on a tiny model, 3,000
steps of about 3 ms (a sleep is the workload) with ``every="auto"``, then the same with a
fixed ``every=20``. Prints the overhead (time the training thread was blocked by
checkpoints / wall time of the loop) against the 3.5 % budget, the checkpoints taken, the
interval the rank adopted and the one the coordinator's API and ``checkflow status`` show::

    .venv/bin/python benchmarks/auto_interval.py
    .venv/bin/python benchmarks/auto_interval.py --steps 1000 --step-s 0.01
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' helpers


def status_line(url: str, job: str) -> str:
    from checkflow.cli.app import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["status", url])
    return next((line for line in out.getvalue().splitlines() if line.startswith(job)), "")


def main() -> None:
    from checkflow.interval import DEFAULT_MAX_OVERHEAD
    from tests.support.coordinator import TOKEN, served
    from tests.support.interval_journey import run

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--step-s", type=float, default=0.003)
    args = p.parse_args()
    os.environ["CHECKFLOW_TOKEN"] = TOKEN  # for `checkflow status`
    with tempfile.TemporaryDirectory() as tmp, served(Path(tmp) / "c.db") as server:
        for job, every in (("auto", "auto"), ("fixed-20", 20)):
            r = run(
                server, Path(tmp) / job, job, every=every, steps=args.steps, step_s=args.step_s,
                status=lambda job=job: status_line(server.url, job),
            )  # fmt: skip
            shown = r.shown
            modes = sorted({(s.interval, s.mode) for s in r.samples})
            below = sum(1 for s in r.samples if s.next_checkpoint <= (s.restore or 0))
            print(
                f"every={every!r}: {r.steps} steps of {args.step_s * 1000:.0f} ms in "
                f"{r.wall_s:.2f} s; blocked {r.blocked_s:.3f} s = {100 * r.overhead:.2f} % "
                f"(budget {100 * DEFAULT_MAX_OVERHEAD:.1f} %); {r.taken} checkpoints, "
                f"{r.waits} waits ({r.waited_s:.2f} s)\n"
                f"  adopted interval {r.adopted} (after {r.extra_steps} more steps); API "
                f"{shown.interval if shown else None} {shown.schedule.mode if shown else ''}; "
                f"status: {r.status.split()}\n"
                f"  sampled every 100 steps: {len(modes)} distinct (interval, mode), first "
                f"{modes[:3]}; next <= restore in {below} of {len(r.samples)} samples"
            )


if __name__ == "__main__":
    main()
