"""The 100k-GPU scenario of ``coordinator.py`` (issue 33): 12,500 simulated node agents of
8 ranks each, one job, one replica, every node heartbeating once per interval.

The load generator is one or more processes (``--load-procs``), each driving every K-th
node on its own uvloop, one keep-alive connection per node: a node's heartbeat waits for
its previous reply, like an agent. They share the measured window through shared memory
(``time.monotonic`` is one clock for every process). With ``--pin`` the server runs on
core 0 and the generators on the other cores, so each side's CPU share can be read apart:
a generator near 100 % of its core while the server is not means the generator is the
bottleneck (then run more of them on more cores).

Per run: offered and sustained node heartbeats/s (rank heartbeats/s = 8x), p50/p99/max of
the reply latency, how late sends left against their schedule (a saturated server shows
up here, not only in latency: a sender waits for its previous reply), errors, the server's
and the generators' CPU, and ranks declared failed although they never stopped (false
failures: the server answered too late for the heartbeat timeout).
"""

from __future__ import annotations

import array
import asyncio
import math
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from _coordinator_net import TOKEN, HttpConn, connect, cpu_seconds, pct, runqueue_wait_s

FLEET = "fleet100k"
"""The scenario's name in ``coordinator.py --scenarios``."""
GPUS_PER_NODE = 8
INTERVAL_S = 1.0
"""The clients' default heartbeat interval (``CoordinatorClient(heartbeat_interval_s=1.0)``)."""
TIMEOUT_S = 10.0
"""The clients' default heartbeat timeout (``CoordinatorClient(heartbeat_timeout_s=10.0)``)."""
SETUP_INTERVAL_S = 4.0
"""Heartbeat interval of the nodes already registered while the others register: within
the 10 s timeout, and within uvicorn's 5 s keep-alive (at 6 s every node reconnected on
each beat, and the reconnects overflowed the server's accept queue)."""
REQUEST_TIMEOUT_S = 15.0
"""A reply later than this is given up on (the timeout is 10 s: the ranks were lost anyway)."""
STATUS = '"iteration_s":1.0,"stall_s":0.01,"persist_s":0.5'


@dataclass
class Fleet:
    nodes: int = 12_500
    duration: float = 20.0
    load_procs: int = 1
    pin: bool = False
    windows: int = 3
    """Measured windows, one after the other, on the one registered fleet."""
    register_concurrency: int = 256
    """Nodes registering at once (all 12,500 at once only measures a queue)."""


@dataclass
class FleetResult:
    fleet: Fleet
    requests: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    lateness: list[float] = field(default_factory=list)
    """Seconds each measured send left after its scheduled time."""
    client_lag: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0
    server_runq_s: float = 0.0
    client_cpu_s: list[float] = field(default_factory=list)
    false_failures: int = 0
    setup_s: float = 0.0


def node_body(node: int, step: int) -> bytes:
    """A node agent's heartbeat for its 8 ranks (generation 1: no failure in this run)."""
    first = node * GPUS_PER_NODE
    ranks = ",".join(
        f'{{"rank":{r},"generation":1,"step":{step},{STATUS}}}'
        for r in range(first, first + GPUS_PER_NODE)
    )
    return f'{{"ranks":[{ranks}]}}'.encode()


def server_cpus() -> set[int]:
    """The server's core under ``--pin``: the first this process may run on."""
    return {min(os.sched_getaffinity(0))}


def generator_cpus() -> set[int]:
    """The generators' cores under ``--pin``: all the others."""
    return (os.sched_getaffinity(0) - server_cpus()) or server_cpus()


async def _agents(k: int, fleet: Fleet, port: int, job: str, shared: Any) -> dict[str, bytes]:
    """Generator ``k``: its nodes register their ranks, then heartbeat until the stop time.

    Until every node has registered (``phase[0]``), registered nodes heartbeat every
    ``SETUP_INTERVAL_S``: that keeps them alive, and leaves the server room to
    register the rest (at the full rate, 100,000 registrations queue behind the heartbeats
    of the nodes already up). Every send from ``phase[1]`` on is recorded: when it left,
    its latency, how late it left, whether it got 200.
    """
    registered, phase = shared
    mine = range(k, fleet.nodes, fleet.load_procs)
    gate = asyncio.Semaphore(max(1, fleet.register_concurrency // fleet.load_procs))
    rng = random.Random(k)
    rec = {name: array.array("d") for name in ("sent", "lat", "late", "ok", "lag_at", "lag")}

    async def node(i: int) -> None:
        path = f"/v1/jobs/{job}/nodes/node-{i:05d}/heartbeat"
        async with gate:
            # Connect when this node's turn comes: 12,500 connects at once overflow the
            # server's accept queue, and dropped SYNs retry for minutes.
            conn = await _reconnect(port)
            for r in range(i * GPUS_PER_NODE, (i + 1) * GPUS_PER_NODE):
                # An instance id: a registration sent again after a timeout is a retry,
                # not a restarted rank (which would fail the job's generation).
                body = f'{{"instance":"n{i}-r{r}","node":"node-{i:05d}"}}'.encode()
                code = 0
                for _ in range(20):  # an overloaded server: keep trying, as an agent would
                    code, conn = await _send(conn, port, f"/v1/jobs/{job}/ranks/{r}/register", body)
                    if code == 200:
                        break
                assert code == 200, code
            code, conn = await _send(conn, port, path, node_body(i, 0))
            assert code == 200, code
        with registered.get_lock():
            registered.value += 1
        offset = rng.random()  # nodes' timers are independent: a phase of their own
        t, step, fast = time.monotonic() + offset * SETUP_INTERVAL_S, 0, False
        while t < phase[2]:
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            step += 1
            start, sent = time.perf_counter(), time.monotonic()
            code, conn = await _send(conn, port, path, node_body(i, step))
            if sent >= phase[1]:
                values = (sent, time.perf_counter() - start, sent - t, code == 200)
                for name, value in zip(rec, values, strict=False):  # the first four columns
                    rec[name].append(value)
            if not fast and time.monotonic() >= phase[0]:
                fast, t = True, phase[0] + offset * INTERVAL_S  # this node's full-rate phase
                t += INTERVAL_S * max(0, math.ceil(time.monotonic() - t))
            else:
                t += INTERVAL_S if fast else SETUP_INTERVAL_S
        conn.close()

    async def lag_probe() -> None:
        while time.monotonic() < phase[2]:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            if t >= phase[1]:
                rec["lag_at"].append(t)
                rec["lag"].append(time.monotonic() - t - 0.005)

    await asyncio.gather(lag_probe(), *(node(i) for i in mine))
    return {name: values.tobytes() for name, values in rec.items()}


async def _send(conn: HttpConn, port: int, path: str, body: bytes) -> tuple[int, HttpConn]:
    """POST ``body``; on a connection the server closed meanwhile, or no reply within
    ``REQUEST_TIMEOUT_S``, once more on a new one (an agent would too). A second failure
    is status 0. Without the timeout, a connection the server's full accept queue dropped
    after the client saw it open waited for good (and the run with it)."""
    for attempt in range(2):
        try:
            code, _ = await asyncio.wait_for(conn.request("POST", path, body), REQUEST_TIMEOUT_S)
            return code, conn
        except (ConnectionError, TimeoutError):
            conn.close()
            if attempt == 0:
                conn = await _reconnect(port)
    return 0, conn


async def _reconnect(port: int) -> HttpConn:
    """A new connection; a refused or timed-out connect is tried again for up to a minute
    (a full accept queue drops connects until the server catches up)."""
    for _ in range(60):
        try:
            return await connect(port)
        except OSError:
            await asyncio.sleep(1.0)
    return await connect(port)


def _generator_main(k: int, fleet: Fleet, port: int, job: str, shared: Any, queue: Any) -> None:
    import gc

    import uvloop

    if fleet.pin:
        os.sched_setaffinity(0, generator_cpus())
    gc.disable()  # the generator must not pause mid-window
    queue.put(uvloop.run(_agents(k, fleet, port, job, shared)))


def run_fleet(fleet: Fleet, port: int, server_pid: int) -> list[FleetResult]:
    """One fleet against the server on ``port`` (pid ``server_pid``, for its CPU): it
    registers once (minutes at 100,000 ranks), then ``fleet.windows`` measured windows of
    ``fleet.duration`` follow each other, 2 s apart. One result per window."""
    job = f"fleet-{os.getpid()}-{time.monotonic_ns()}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"http://127.0.0.1:{port}/v1/jobs"
    size = fleet.nodes * GPUS_PER_NODE
    body = {"name": job, "world_size": size, "heartbeat_timeout_s": TIMEOUT_S}
    httpx.post(url, json=body, headers=headers, timeout=30).raise_for_status()
    ctx = mp.get_context("spawn")
    registered = ctx.Value("i", 0)
    phase = ctx.Array("d", [math.inf] * 3, lock=False)  # full rate, record, stop (monotonic)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_generator_main, args=(k, fleet, port, job, (registered, phase), queue))
        for k in range(fleet.load_procs)
    ]
    began = time.monotonic()
    for p in procs:
        p.start()
    setup_s = _wait_registered(registered, fleet.nodes, procs, began)
    phase[0] = time.monotonic()
    first = phase[0] + SETUP_INTERVAL_S + 3 * INTERVAL_S  # every node at the full rate
    windows = [
        (s, s + fleet.duration)
        for s in (first + w * (fleet.duration + 2) for w in range(fleet.windows))
    ]
    phase[1], phase[2] = first, windows[-1][1] + INTERVAL_S
    samples = []
    for edge in sorted({x for w in windows for x in w}):
        time.sleep(max(0.0, edge - time.monotonic()))
        samples.append(
            (edge, [cpu_seconds(server_pid), runqueue_wait_s(server_pid), *map(_cpu, procs)])
        )
    recs = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    events = httpx.get(f"{url}/{job}/events?limit=10000", headers=headers, timeout=60).json()
    failed = sum(1 for e in events["events"] if e["kind"] == "rank_failed")
    cpu = dict(samples)
    return [_window(fleet, w, cpu, recs, setup_s, failed) for w in windows]


def _window(
    fleet: Fleet,
    window: tuple[float, float],
    cpu: dict[float, list[float]],
    recs: list[dict[str, bytes]],
    setup_s: float,
    failed: int,
) -> FleetResult:
    """The figures of one measured window, from the generators' records."""
    start, end = window
    res = FleetResult(fleet, setup_s=setup_s, false_failures=failed)
    before, after = cpu[start], cpu[end]
    res.server_cpu_s, res.server_runq_s = after[0] - before[0], after[1] - before[1]
    res.client_cpu_s = [a - b for a, b in zip(after[2:], before[2:], strict=True)]
    for rec in recs:
        cols = {name: array.array("d", raw) for name, raw in rec.items()}
        for sent, lat, late, ok in zip(
            cols["sent"], cols["lat"], cols["late"], cols["ok"], strict=True
        ):
            if start <= sent < end:
                res.requests += 1
                res.errors += not ok
                res.latencies.append(lat)
                res.lateness.append(late)
        res.client_lag += [
            g for at, g in zip(cols["lag_at"], cols["lag"], strict=True) if start <= at < end
        ]
    return res


def _cpu(proc: Any) -> float:
    return cpu_seconds(proc.pid)


def _wait_registered(registered: Any, nodes: int, procs: list[Any], began: float) -> float:
    """Seconds until every node has registered its ranks; fails if a generator died."""
    last = 0.0
    while registered.value < nodes:
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError("a load generator died while registering (see its traceback)")
        if time.monotonic() - last > 15:
            print(f"  registered {registered.value}/{nodes} nodes", flush=True)
            last = time.monotonic()
        time.sleep(0.2)
    return time.monotonic() - began


def _row(r: FleetResult) -> dict[str, str]:
    lat, late, w = sorted(r.latencies), sorted(r.lateness), r.fleet.duration
    rate = r.requests / w
    return {
        "gen procs": str(r.fleet.load_procs),
        "setup s": f"{r.setup_s:.0f}",
        "offered node hb/s": f"{r.fleet.nodes / INTERVAL_S:.0f}",
        "sustained node hb/s": f"{rate:.0f}",
        "rank hb/s": f"{rate * GPUS_PER_NODE:.0f}",
        "p50 ms": f"{statistics.median(lat) * 1e3:.2f}" if lat else "-",
        "p99 ms": f"{pct(lat, 99) * 1e3:.2f}",
        "max ms": f"{lat[-1] * 1e3:.0f}" if lat else "-",
        "sends late p99 ms": f"{pct(late, 99) * 1e3:.0f}",
        "errors": str(r.errors),
        "server CPU": f"{r.server_cpu_s / w:.0%}",
        "server runq wait": f"{r.server_runq_s / w:.0%}",
        "gen CPU": "+".join(f"{c / w:.0%}" for c in r.client_cpu_s),
        "gen lag p99 ms": f"{pct(sorted(r.client_lag), 99) * 1e3:.1f}",
        "server CPU us/req": f"{r.server_cpu_s / r.requests * 1e6:.0f}" if r.requests else "-",
        "false failures": str(r.false_failures),
    }


def print_fleet(results: list[FleetResult], summary: bool = False) -> None:
    """One row per run; with ``summary``, per generator setting the median of the runs and
    their spread (min-max) of the rate and the latencies."""
    rows = [_row(r) for r in results]
    head = list(rows[0])
    widths = [max(len(h), *(len(row[h]) for row in rows)) for h in head]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(row[h].ljust(w) for h, w in zip(head, widths, strict=True)))
    if not summary:
        return
    for procs in sorted({r.fleet.load_procs for r in results}):
        runs = [r for r in results if r.fleet.load_procs == procs]
        rate = [r.requests / r.fleet.duration for r in runs]
        p50 = [statistics.median(r.latencies) * 1e3 for r in runs if r.latencies]
        p99 = [pct(sorted(r.latencies), 99) * 1e3 for r in runs]
        print(
            f"{procs} generator process(es), {len(runs)} runs: sustained node hb/s median "
            f"{statistics.median(rate):.0f} ({min(rate):.0f}-{max(rate):.0f}); p50 ms "
            f"{statistics.median(p50):.2f} ({min(p50):.2f}-{max(p50):.2f}); p99 ms "
            f"{statistics.median(p99):.2f} ({min(p99):.2f}-{max(p99):.2f})"
        )
