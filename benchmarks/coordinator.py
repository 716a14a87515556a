"""Coordinator load benchmark: simulated ranks heartbeating at 1 Hz against one uvicorn worker.

The server runs ``checkflow serve`` in its own process (state persisted in SQLite, WAL);
this process is the load generator: raw HTTP/1.1 over keep-alive connections on uvloop,
one connection per sender, so that the client is not the bottleneck. Per scenario it
reports achieved request rate, client-side p50/p99 latency, errors, the server's CPU, and
the failure-detection latency when 1 % of ranks go silent (server-side: time from a rank's
last heartbeat to its ``rank_failed`` event; must be <= timeout + 1 s).

    .venv/bin/python benchmarks/coordinator.py                      # all scenarios, 20 s each
    .venv/bin/python benchmarks/coordinator.py --duration 10 --scenarios node4096,rank2048

Issue 33's scenarios (each in its own module):

- ``fleet100k`` (``_coordinator_fleet.py``): 12,500 node agents of 8 ranks, one replica,
  one or more generator processes (``--load-procs``, ``--pin``), ``--repeats`` windows:
      .venv/bin/python benchmarks/coordinator.py --scenarios fleet100k --pin
- ``failover``, ``jobs1000`` (``_coordinator_failover.py``): 2 replicas on PostgreSQL
  (``--db postgresql://...``, else a throwaway cluster from ``_postgres.py``), the owner
  SIGKILLed, the time until the new owner detects a silent rank. They need the server side
  of issue 33 and say so in one line (exit 2) on a server without it.

``--db`` is handed to every ``checkflow serve`` (default: a fresh SQLite file per run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from _coordinator_failover import (  # noqa: E402
    FAILOVER_SCENARIOS,
    FailoverResult,
    MissingServerSupport,
    print_failover,
    run_failover,
)
from _coordinator_fleet import FLEET, Fleet, FleetResult, print_fleet, run_fleet, server_cpus  # noqa: E402
from _coordinator_net import (  # noqa: E402
    TOKEN,
    connect,
    cpu_seconds,
    free_port,
    pct,
    runqueue_wait_s,
    start_server,
    stop_server,
)

__all__ = ["TOKEN", "free_port", "start_server"]  # what recovery.py imports from here

TIMEOUT_S = 3.0
"""Heartbeat timeout of the benchmark jobs: silent ranks must be found within 4 s."""


@dataclass
class Scenario:
    name: str
    ranks: int
    per_request: int
    """Ranks carried by one heartbeat request (8: one per node; 1: one per rank)."""

    @property
    def senders(self) -> int:
        return self.ranks // self.per_request


SCENARIOS = {
    "node4096": Scenario("4,096 ranks, 1 heartbeat/node (8 ranks)", 4096, 8),
    "node8192": Scenario("8,192 ranks, 1 heartbeat/node (8 ranks)", 8192, 8),
    "rank2048": Scenario("2,048 ranks, 1 heartbeat/rank", 2048, 1),
}


@dataclass
class Result:
    scenario: Scenario
    requests: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    duration: float = 0.0
    cpu_s: float = 0.0
    detect: list[float] = field(default_factory=list)
    """Server-side silence of each silent rank when declared failed."""
    silent: set[int] = field(default_factory=set)
    false_failures: int = 0
    """Ranks that kept heartbeating but were declared failed (replies came too late)."""
    client_cpu_s: float = 0.0
    runq_wait_s: float = 0.0
    """Time the server was runnable but waiting for a CPU (other processes had them)."""
    client_lag: list[float] = field(default_factory=list)
    """How late the load generator's own 5 ms timer fired (its event loop was busy): a
    reply is timed when this loop gets to it, so this bounds the generator's own error."""


async def setup_job(port: int, job: str, ranks: int) -> None:
    conn = await connect(port)
    body = json.dumps({"name": job, "world_size": ranks, "heartbeat_timeout_s": TIMEOUT_S})
    status, _ = await conn.request("POST", "/v1/jobs", body.encode())
    assert status in (200, 201), status
    assert conn.transport is not None
    conn.transport.close()


async def run_load(port: int, sc: Scenario, job: str, duration: float, pid: int) -> Result:
    """Each sender registers its ranks, then heartbeats once per second at its own phase.

    Phases are drawn uniformly at random over the 1 s period (seeded): nodes start
    independently, so their heartbeat timers are not synchronized. Starting each sender's
    timer when its registration finished instead put them in a few waves (registrations
    complete together), and the waves, not the server, made the latency tail.

    The measured window starts 2 s after the last registration (registering thousands of
    ranks takes longer than the heartbeat timeout, so heartbeats must start right away).
    After the window, 1 % of the ranks go silent and the run goes on until they are found.
    """
    res = Result(sc)
    rng = random.Random(0)
    silent = set(rng.sample(range(sc.ranks), max(1, sc.ranks // 100)))
    phases = [rng.random() for _ in range(sc.senders)]
    loop = asyncio.get_running_loop()
    epoch = loop.time()
    inf = float("inf")
    win = {"start": inf, "end": inf, "stop": inf}
    registered = 0
    all_registered = asyncio.Event()
    cpu: dict[str, float] = {}

    async def sender(i: int) -> None:
        nonlocal registered
        conn = await connect(port)
        ranks = list(range(i * sc.per_request, (i + 1) * sc.per_request))
        if sc.per_request == 1:
            path = f"/v1/jobs/{job}/ranks/{ranks[0]}/heartbeat"
        else:
            path = f"/v1/jobs/{job}/nodes/node-{i:05d}/heartbeat"
        for k, r in enumerate(ranks):
            status, _ = await conn.request("POST", f"/v1/jobs/{job}/ranks/{r}/register", b"{}")
            assert status == 200, status
            if sc.per_request > 1:
                # Like a node agent: report the ranks registered so far at once, so none of
                # them waits for its node's other registrations (slower than the timeout
                # when thousands of ranks register together on a loaded machine).
                done = [{"rank": q, "generation": 1, "step": 0} for q in ranks[: k + 1]]
                status, _ = await conn.request("POST", path, json.dumps({"ranks": done}).encode())
                assert status == 200, status
        registered += 1
        if registered == sc.senders:
            all_registered.set()
        step = 0
        # First beat at this sender's phase, within 1 s of its registration (< timeout).
        t = epoch + phases[i] + math.ceil(loop.time() - epoch - phases[i])
        while t < win["stop"]:
            await asyncio.sleep(max(0.0, t - loop.time()))
            live = [r for r in ranks if not (t >= win["end"] and r in silent)]
            step += 1
            if live:
                status = {
                    "generation": 1,
                    "step": step,
                    "iteration_s": 1.0,
                    "stall_s": 0.01,
                    "persist_s": 0.5,
                }
                if sc.per_request == 1:
                    body = json.dumps(status).encode()
                else:
                    body = json.dumps({"ranks": [{"rank": r, **status} for r in live]}).encode()
                start = time.perf_counter()
                try:
                    code, _ = await conn.request("POST", path, body)
                except ConnectionError:
                    code = 0
                end = time.perf_counter()
                if win["start"] <= loop.time() < win["end"]:
                    res.requests += 1
                    res.latencies.append(end - start)
                    if code != 200:
                        res.errors += 1
            t += 1.0
        assert conn.transport is not None
        conn.transport.close()

    async def window() -> None:
        await all_registered.wait()
        await asyncio.sleep(2.0)
        win["start"] = loop.time()
        win["end"] = win["start"] + duration
        win["stop"] = win["end"] + TIMEOUT_S + 2.0  # silent ranks must be found by then
        cpu["start"], cpu["client_start"] = cpu_seconds(pid), time.process_time()
        cpu["wait_start"] = runqueue_wait_s(pid)
        while loop.time() < win["end"]:
            t = loop.time()
            await asyncio.sleep(0.005)
            res.client_lag.append(loop.time() - t - 0.005)
        cpu["end"], cpu["client_end"] = cpu_seconds(pid), time.process_time()
        cpu["wait_end"] = runqueue_wait_s(pid)

    await asyncio.gather(window(), *(sender(i) for i in range(sc.senders)))
    res.duration = duration
    res.cpu_s = cpu["end"] - cpu["start"]
    res.client_cpu_s = cpu["client_end"] - cpu["client_start"]
    res.runq_wait_s = cpu["wait_end"] - cpu["wait_start"]
    res.silent = silent
    return res


def record_detections(port: int, job: str, res: Result) -> None:
    events = httpx.get(
        f"http://127.0.0.1:{port}/v1/jobs/{job}/events?limit=10000",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    ).json()["events"]
    failed = {e["rank"]: e["detail"]["silent_s"] for e in events if e["kind"] == "rank_failed"}
    res.detect = [failed[r] for r in res.silent if r in failed]
    res.false_failures = sum(1 for r in failed if r not in res.silent)


def run_scenario(sc: Scenario, duration: float, db: str | None) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_server(db or Path(tmp) / "coordinator.db", port)
        try:
            import uvloop

            job = f"bench-{os.getpid()}-{time.monotonic_ns()}"  # unique in a shared database
            uvloop.run(setup_job(port, job, sc.ranks))
            res = uvloop.run(run_load(port, sc, job, duration, proc.pid))
            record_detections(port, job, res)
        finally:
            stop_server(proc)
    return res


def run_fleets(args: argparse.Namespace) -> list[FleetResult]:
    """``fleet100k``: per ``--load-procs`` setting, one server and one fleet that registers
    once, then ``--repeats`` measured windows (registering 100,000 ranks takes minutes)."""
    results: list[FleetResult] = []
    for procs in (int(x) for x in args.load_procs.split(",")):
        fleet = Fleet(args.nodes, args.duration, procs, args.pin, windows=args.repeats)
        print(f"fleet: {fleet.nodes} nodes, {procs} generator process(es), pin={args.pin}, "
              f"{args.repeats} windows of {args.duration:.0f} s ...", flush=True)  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            cpus = server_cpus() if args.pin else None
            proc = start_server(args.db or Path(tmp) / "coordinator.db", port, cpus=cpus)
            try:
                results += run_fleet(fleet, port, proc.pid)
            finally:
                stop_server(proc)
        print_fleet(results[-args.repeats :])
    return results


def run_failovers(keys: list[str], db: str | None) -> list[FailoverResult]:
    """The failover scenarios against ``db``, or a throwaway PostgreSQL when none."""
    from _postgres import throwaway_postgres

    with contextlib.ExitStack() as stack:
        url = db or stack.enter_context(throwaway_postgres({"max_connections": "300"}))
        results = []
        for key in keys:
            sc = FAILOVER_SCENARIOS[key]
            print(f"running: {sc.name}, owner SIGKILLed ...", flush=True)
            results.append(run_failover(sc, url))
            print_failover(results[-1:])
        return results


def print_table(results: list[Result]) -> None:
    head = [
        "scenario",
        "senders",
        "req/s",
        "rank hb/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "errors",
        "server CPU",
        "server runq wait",
        "client CPU",
        "client lag p99 ms",
        "CPU us/req",
        "CPU us/rank",
        f"silent found <= {TIMEOUT_S + 1:.0f} s",
        "max detect s",
        "false failures",
    ]
    rows = []
    for r in results:
        sc, lat = r.scenario, sorted(r.latencies)
        rate = r.requests / r.duration
        cpu_per_req = r.cpu_s / r.requests * 1e6 if r.requests else 0.0
        rows.append([
            sc.name, str(sc.senders), f"{rate:.0f}", f"{rate * sc.per_request:.0f}",
            f"{statistics.median(lat) * 1e3:.2f}", f"{pct(lat, 99) * 1e3:.2f}",
            f"{lat[-1] * 1e3:.1f}", str(r.errors), f"{r.cpu_s / r.duration:.0%}",
            f"{r.runq_wait_s / r.duration:.0%}",
            f"{r.client_cpu_s / r.duration:.0%}", f"{pct(sorted(r.client_lag), 99) * 1e3:.2f}",
            f"{cpu_per_req:.0f}",
            f"{cpu_per_req / sc.per_request:.0f}",
            f"{sum(d <= TIMEOUT_S + 1 for d in r.detect)}/{len(r.silent)}",
            f"{max(r.detect, default=float('nan')):.2f}", str(r.false_failures),
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per scenario")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=",".join([*SCENARIOS, FLEET, *FAILOVER_SCENARIOS]),
    )
    p.add_argument("--db", help="the server's --db (default: a fresh SQLite file per run); "
                   "a postgresql:// URL where the server supports it")  # fmt: skip
    fleet = p.add_argument_group(f"{FLEET}: node agents of a 100k-GPU job")
    fleet.add_argument("--nodes", type=int, default=12_500, help="nodes of 8 ranks (12,500)")
    fleet.add_argument("--load-procs", default="1", help="generator processes; a comma list "
                       "is run interleaved (1,2)")  # fmt: skip
    fleet.add_argument("--pin", action="store_true", help="server on core 0, load on the rest")
    fleet.add_argument("--repeats", type=int, default=3, help="measured windows per fleet")
    args = p.parse_args()
    gc.disable()  # the load generator must not pause; it runs for a minute at most
    results, fleets, failovers = [], [], []
    load_before = os.getloadavg()[0]
    keys = args.scenarios.split(",")
    unknown = [k for k in keys if k not in {*SCENARIOS, FLEET, *FAILOVER_SCENARIOS}]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}")
    try:
        failovers = run_failovers([k for k in keys if k in FAILOVER_SCENARIOS], args.db)
    except MissingServerSupport as e:
        print(f"coordinator.py: {e}", file=sys.stderr)
        return 2
    for key in (k for k in keys if k not in FAILOVER_SCENARIOS):
        if key == FLEET:
            fleets = run_fleets(args)
            continue
        sc = SCENARIOS[key]
        print(f"running: {sc.name} ({args.duration:.0f} s measured) ...", flush=True)
        results.append(run_scenario(sc, args.duration, args.db))
    print(
        f"\nmachine: {os.cpu_count()} CPUs, load generator and server on the same host; "
        f"load average at start {load_before:.1f}, at end {os.getloadavg()[0]:.1f}"
    )
    if results:
        print_table(results)
    if fleets:
        print_fleet(fleets, summary=True)
    if failovers:
        print_failover(failovers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
