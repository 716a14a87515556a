"""Coordinator load benchmark: simulated ranks heartbeating at 1 Hz against one uvicorn worker.

The server runs ``checkflow serve`` in its own process (state persisted in SQLite, WAL);
this process is the load generator: raw HTTP/1.1 over keep-alive connections on uvloop,
one connection per sender, so that the client is not the bottleneck. Per scenario it
reports achieved request rate, client-side p50/p99 latency, errors, the server's CPU, and
the failure-detection latency when 1 % of ranks go silent (server-side: time from a rank's
last heartbeat to its ``rank_failed`` event; must be <= timeout + 1 s).

    .venv/bin/python benchmarks/coordinator.py                      # all scenarios, 20 s each
    .venv/bin/python benchmarks/coordinator.py --duration 10 --scenarios node4096,rank2048
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TOKEN = "bench"
TIMEOUT_S = 3.0
"""Heartbeat timeout of the benchmark jobs: silent ranks must be found within 4 s."""
SERVE = "import sys; from checkflow.cli import main; sys.exit(main(sys.argv[1:]))"


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


class HttpConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request in flight."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's own class

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
        if len(self.buf) < end + 4 + length:
            return
        status = int(self.buf[9:12])
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    async def request(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(
            f"{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        return await self.waiter


async def connect(port: int) -> HttpConn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(HttpConn, "127.0.0.1", port)
    return conn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's threads waited for a CPU while runnable (scheduler contention)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def start_server(db: Path, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-c",
        SERVE,
        "serve",
        "--port",
        str(port),
        "--db",
        str(db),
        "--token",
        TOKEN,
        "--log-level",
        "error",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("coordinator did not start")


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


def run_scenario(sc: Scenario, duration: float) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_server(Path(tmp) / "coordinator.db", port)
        try:
            import uvloop

            job = "bench"
            uvloop.run(setup_job(port, job, sc.ranks))
            res = uvloop.run(run_load(port, sc, job, duration, proc.pid))
            record_detections(port, job, res)
        finally:
            proc.terminate()
            proc.wait(10)
    return res


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 10) - 1] if len(values) > 1 else 0.0


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
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=",".join(SCENARIOS))
    args = p.parse_args()
    gc.disable()  # the load generator must not pause; it runs for a minute at most
    results = []
    load_before = os.getloadavg()[0]
    for key in args.scenarios.split(","):
        sc = SCENARIOS[key]
        print(f"running: {sc.name} ({args.duration:.0f} s measured) ...", flush=True)
        results.append(run_scenario(sc, args.duration))
    print(
        f"\nmachine: {os.cpu_count()} CPUs, load generator and server on the same host; "
        f"load average at start {load_before:.1f}, at end {os.getloadavg()[0]:.1f}"
    )
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
