"""Does a torchrun restart on gloo survive one SIGKILLed rank? Reproduces issue 10's
``connectFullMesh`` failure and shows its cause.

Each try launches a 2-rank gloo job under ``torchrun --standalone --max-restarts=1``.
In the first round rank 1 SIGKILLs itself after a few all-reduces; the agent restarts both
ranks, which must join a new process group and finish. Before ``init_process_group`` every
worker looks into the store the workers bootstrap from (``MASTER_ADDR:MASTER_PORT``) for
the key gloo's full-mesh rendezvous reads, and prints whether the previous round left it
there. With the agent's shared store (torch's default) it is there: a restarted rank can
read its peer's old, dead address and fail with "connection refused" or hang; with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every round has a fresh store and the key is absent.

Usage::

    python benchmarks/torchrun_restart.py --tries 10            # torch's default
    python benchmarks/torchrun_restart.py --tries 10 --fresh    # a store per round
    python benchmarks/torchrun_restart.py --tries 10 --launcher checkflow
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

STEPS = 20
KILL_AT = 5
GLOO_KEY = "default_pg/0//cpu//0/{rank}"
"""The key under which a rank's gloo context publishes its address, and its peers' full-mesh
connect reads it (``PrefixStore`` nesting ``default_pg`` / group ``0`` / device ``cpu``,
then gloo's ``<context>/<rank>``)."""


def worker() -> None:
    """One rank: report stale keys, join gloo, all-reduce ``STEPS`` times, die once."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Worker rank 0 hosts a new store in init_process_group: nothing to look into yet,
        # and nothing in it can come from an earlier round.
        print(f"REPORT round={restart} rank={rank} peer_key_before_join=fresh-store", flush=True)
        dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    else:
        _join_shared(rank, restart)
    t = torch.ones(1)
    for step in range(STEPS):
        if restart == 0 and rank == 1 and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
        time.sleep(0.05)
    print(f"DONE round={restart} rank={rank}", flush=True)
    dist.destroy_process_group()


def _join_shared(rank: int, restart: int) -> None:
    """Join through the agent's shared store, reporting the peer's key found there first."""
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=10),
    )
    peer = GLOO_KEY.format(rank=1 - rank)
    seen = _digest(store.get(peer)) if store.check([peer]) else "absent"
    print(f"REPORT round={restart} rank={rank} peer_key_before_join={seen}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    own = _digest(store.get(GLOO_KEY.format(rank=rank)))
    print(f"REPORT round={restart} rank={rank} own_key_after_join={own}", flush=True)


def _digest(value: bytes) -> str:
    return hashlib.sha1(value).hexdigest()[:10]


def one_try(launcher: str, fresh: bool, timeout: float) -> tuple[str, bool, str]:
    """Run one job; returns (outcome, stale key seen in round 1, last lines of output)."""
    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if fresh:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"]
    else:
        cmd = [sys.executable, "-m", "checkflow.cli", "run"]
    cmd += ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
    cmd += [__file__, "--worker"]
    with tempfile.TemporaryFile("w+") as out:
        # Its own session: a hung try is killed with all its workers.
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        out.seek(0)
        text = out.read()
    done = set(re.findall(r"DONE round=1 rank=(\d)", text))
    stale = _read_stale(text)
    if rc is None:
        outcome = "hung"
    elif rc == 0 and done == {"0", "1"}:
        outcome = "ok"
    else:
        outcome = "failed" + (" (connectFullMesh)" if "connectFullMesh" in text else "")
    evidence = [ln for ln in text.splitlines() if "REPORT" in ln or "connectFullMesh" in ln]
    return outcome, stale, "\n".join(evidence[:12])


def _read_stale(text: str) -> bool:
    """Did a restarted rank find, before joining, the address its peer published in round 0?"""
    published = dict(re.findall(r"round=0 rank=(\d) own_key_after_join=(\w+)", text))
    seen = dict(re.findall(r"round=1 rank=(\d) peer_key_before_join=(\w+)", text))
    return any(published.get(str(1 - int(rank))) == value for rank, value in seen.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--fresh", action="store_true", help="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    parser.add_argument("--launcher", choices=["torchrun", "checkflow"], default="torchrun")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before a try hangs")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failure's output")
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    results = []
    for i in range(args.tries):
        start = time.monotonic()
        outcome, stale, tail = one_try(args.launcher, args.fresh, args.timeout)
        results.append(outcome)
        print(
            f"try {i + 1}: {outcome:28s} stale gloo key in round 1: {stale}  "
            f"({time.monotonic() - start:.1f} s)",
            flush=True,
        )
        if outcome != "ok" and args.verbose:
            print(tail, flush=True)
    failed = sum(r != "ok" for r in results)
    mode = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" if args.fresh else "no variable set"
    print(f"{args.launcher}, {mode}: {failed} of {len(results)} restarts failed or hung")


if __name__ == "__main__":
    main()
