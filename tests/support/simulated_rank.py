"""A simulated rank without torch, for the tests: ``python -m tests.support.simulated_rank
--help`` from the repository root.

It steps, heartbeats and checkpoints on the coordinator's schedule through a real
:class:`~checkflow.client.CoordinatorClient`, printing one JSON line per event (registered,
checkpoint, done) to stdout, and exits with :data:`~checkflow.client.ABORT_EXIT_CODE` when
told to abort. The tests run it as a real client process (``coordinator.start_rank``, and
``checkflow run``'s workers in ``tests/launch/_crash_job.py``); it also tries a coordinator
out. It is test support, not part of the installed package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from checkflow.client.rank import CoordinatorClient


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.support.simulated_rank")
    p.add_argument("--url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--token")
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--stall", type=float, default=0.005, help="reported snapshot stall")
    p.add_argument(
        "--every",
        type=int,
        default=10,
        help="fixed checkpoint interval (a Checkpointer's ranks adopt a tuned one together "
        "at a checkpoint, in their c10d store; simulated ranks have no store)",
    )
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--crash-at", type=int, help="os._exit(1) when reaching this step")
    p.add_argument("--hang-at", type=int, help="stop heartbeating (hang) at this step")
    return p.parse_args(argv)


def simulate_rank(argv: list[str] | None = None) -> int:
    """Run one simulated rank to ``--steps``; the exit status of the process."""
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s rank %(process)d %(levelname)s %(message)s",
    )

    def emit(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, "rank": args.rank, **fields}), flush=True)

    client = CoordinatorClient(
        args.url,
        args.job,
        args.rank,
        args.world_size,
        token=args.token,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        every=args.every,
    )
    reg = client.register()
    start = (reg.restore_step or 0) if reg else 0
    emit("registered", generation=reg.generation if reg else None, start=start)
    client.start()
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_time)
        if step == args.crash_at:
            os._exit(1)
        if step == args.hang_at:
            client._stop.set()  # the heartbeat thread dies with the "hung" process
            time.sleep(3600)
        client.report_progress(step, args.step_time, args.stall, args.step_time)
        if client.schedule is not None and client.schedule.is_checkpoint(step):
            must_commit = client.report_persisted(step, 1000, args.step_time, f"step-{step}")
            if must_commit:
                client.report_committed(step)
            emit("checkpoint", step=step, must_commit=must_commit, generation=client.generation)
    emit("done", step=args.steps, generation=client.generation)
    client.finish()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(simulate_rank())
