"""The failover scenarios of ``coordinator.py`` (issue 33): replicas on one PostgreSQL
database, the owner of the jobs SIGKILLed, the time until the new owner detects a rank
that went silent at the kill.

- ``failover``: one job of 8 ranks (one node) over 2 replicas;
- ``jobs1000``: 1,000 jobs of 2 ranks each (one node each) spread over 2 replicas.

Each job is created through the replicas in turn, its ranks register and commit one
checkpoint, and its node heartbeats once a second through the replica list (following 307
to the owner, sticking to the replica that answered, moving on when one fails), like the
clients. Then the replica owning the most jobs is SIGKILLed; from that moment rank 1 of
each of its jobs is left out of the heartbeats. Reported: for how many of those jobs the
survivor recorded that rank's ``rank_failed``, and when (seconds after the kill: lease
expiry + takeover + the heartbeat timeout, as the new owner restarts the silence clocks);
and whether every checkpoint committed before the kill is still committed (target: none
missing). Needs issue 33's server side (``--db postgresql://``, ``--advertise-url``, 307
from non-owners); on a server without it, it stops with one line saying what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from _coordinator_net import TOKEN, free_port, pct, start_server, stop_server

TIMEOUT_S = 3.0
"""Heartbeat timeout of the jobs (as in the other scenarios)."""
DETECT_LIMIT_S = 60.0
"""Give up waiting for a detection this long after the kill."""
COMMITTED_STEP = 10
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


class MissingServerSupport(RuntimeError):
    """The server lacks what the scenario needs: the message says what."""


@dataclass
class Failover:
    name: str
    jobs: int
    ranks: int


FAILOVER_SCENARIOS = {
    "failover": Failover("1 job of 8 ranks, 2 replicas", 1, 8),
    "jobs1000": Failover("1,000 jobs of 2 ranks, 2 replicas", 1000, 2),
}


@dataclass
class FailoverResult:
    scenario: Failover
    killed_jobs: int = 0
    detect_s: list[float] = field(default_factory=list)
    missing_commits: int = 0
    heartbeat_errors: int = 0


class Node:
    """One node's heartbeats through a replica list, as the clients send them."""

    def __init__(self, urls: list[str], job: str, ranks: int) -> None:
        self.urls, self.job, self.ranks = urls, job, ranks
        self.current = 0
        self.silent: set[int] = set()
        self.errors = 0

    async def post(
        self, http: httpx.AsyncClient, path: str, body: dict[str, Any], method: str = "POST"
    ) -> httpx.Response:
        """POST (or ``method``) to the current replica, following 307; on a failure (no
        answer, 5xx), the next replica."""
        for attempt in range(2 * len(self.urls)):
            url = self.urls[(self.current + attempt) % len(self.urls)]
            try:
                reply = await http.request(
                    method, url + path, json=body, headers=HEADERS, follow_redirects=True
                )
            except httpx.TransportError:
                continue
            if reply.status_code < 500:
                self.current = (self.current + attempt) % len(self.urls)
                return reply
        raise ConnectionError(f"no replica answered {path}")

    async def beat(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        step = 0
        while not stop.is_set():
            step += 1
            live = [r for r in range(self.ranks) if r not in self.silent]
            body = {"ranks": [{"rank": r, "generation": 1, "step": step} for r in live]}
            try:
                reply = await self.post(http, f"/v1/jobs/{self.job}/nodes/node-0/heartbeat", body)
                self.errors += reply.status_code != 200
            except ConnectionError:
                self.errors += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)


async def prepare(
    node: Node, http: httpx.AsyncClient, first: int, stop: asyncio.Event
) -> asyncio.Task[None]:
    """Create the job through replica ``first``, register its ranks, start its heartbeats
    (at once: a registered rank that stays silent for the timeout fails the generation),
    commit one checkpoint. Returns the heartbeat task."""
    node.current = first
    body = {"name": node.job, "world_size": node.ranks, "heartbeat_timeout_s": TIMEOUT_S}
    reply = await node.post(http, "/v1/jobs", body)
    assert reply.status_code in (200, 201), reply.text
    for r in range(node.ranks):
        reply = await node.post(http, f"/v1/jobs/{node.job}/ranks/{r}/register", {"node": "node-0"})
        assert reply.status_code == 200, reply.text
    beat = asyncio.create_task(node.beat(http, stop))
    committer = None
    for r in range(node.ranks):
        part = {
            "generation": 1,
            "nbytes": 1,
            "duration_s": 0.1,
            "manifest_path": f"step-{COMMITTED_STEP}",
        }
        reply = await node.post(
            http, f"/v1/jobs/{node.job}/checkpoints/{COMMITTED_STEP}/ranks/{r}", part, "PUT"
        )
        assert reply.status_code == 200, reply.text
        committer = r if reply.json()["must_commit"] else committer
    assert committer is not None, "no rank was told to commit"
    commit = {"rank": committer, "generation": 1}
    reply = await node.post(
        http, f"/v1/jobs/{node.job}/checkpoints/{COMMITTED_STEP}/commit", commit
    )
    assert reply.status_code == 200, reply.text
    return beat


async def owner_of(http: httpx.AsyncClient, urls: list[str], job: str) -> int:
    """Which replica owns ``job``: the one that answers itself, where the other redirects."""
    codes = []
    for i, url in enumerate(urls):
        reply = await http.get(f"{url}/v1/jobs/{job}", headers=HEADERS, follow_redirects=False)
        codes.append(reply.status_code)
        if reply.status_code == 307:
            target = reply.headers.get("location", "")
            return next(k for k, u in enumerate(urls) if target.startswith(u)) if target else 1 - i
    if codes.count(200) == len(urls):
        raise MissingServerSupport(
            "every replica serves the job itself (no 307 from a non-owner): this server has no "
            "job ownership (issue 33's leases)"
        )
    raise RuntimeError(f"job {job}: replicas answered {codes}")


async def detect(
    http: httpx.AsyncClient, url: str, jobs: list[str], killed_at: float
) -> list[float]:
    """Seconds after the kill at which ``url`` recorded rank 1 of each job as failed."""
    found: dict[str, float] = {}
    while len(found) < len(jobs) and time.monotonic() - killed_at < DETECT_LIMIT_S:
        for job in [j for j in jobs if j not in found]:
            try:
                reply = await http.get(f"{url}/v1/jobs/{job}/events?limit=1000", headers=HEADERS)
            except httpx.TransportError:
                continue
            if reply.status_code == 200 and any(
                e["kind"] == "rank_failed" and e["rank"] == 1 for e in reply.json()["events"]
            ):
                found[job] = time.monotonic() - killed_at
        await asyncio.sleep(0.1)
    return list(found.values())


async def missing_commits(http: httpx.AsyncClient, url: str, jobs: list[str]) -> int:
    missing = 0
    for job in jobs:
        reply = await http.get(f"{url}/v1/jobs/{job}/checkpoints", headers=HEADERS)
        steps = {c["step"] for c in reply.json()["checkpoints"] if c["status"] == "committed"}
        missing += COMMITTED_STEP not in steps
    return missing


async def scenario(sc: Failover, urls: list[str], pids: list[int]) -> FailoverResult:
    res = FailoverResult(sc)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    nodes = [Node(urls, f"fo-{tag}-{j}", sc.ranks) for j in range(sc.jobs)]
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(timeout=10, limits=limits) as http:
        gate, stop = asyncio.Semaphore(50), asyncio.Event()

        async def one(j: int) -> asyncio.Task[None]:
            async with gate:
                return await prepare(nodes[j], http, j % len(urls), stop)

        beats = await asyncio.gather(*(one(j) for j in range(sc.jobs)))
        owners = [await owner_of(http, urls, n.job) for n in nodes]
        victim = max(range(len(urls)), key=owners.count)
        killed = [n for n, o in zip(nodes, owners, strict=True) if o == victim]
        await asyncio.sleep(3.0)  # heartbeats flowing to every owner
        for n in killed:
            n.silent = {1}
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = urls[1 - victim]
        res.killed_jobs = len(killed)
        res.detect_s = await detect(http, survivor, [n.job for n in killed], killed_at)
        stop.set()
        await asyncio.gather(*beats)
        res.missing_commits = await missing_commits(http, survivor, [n.job for n in nodes])
        res.heartbeat_errors = sum(n.errors for n in nodes)
    return res


def run_failover(sc: Failover, db: str) -> FailoverResult:
    """Two replicas on ``db`` (a ``postgresql://`` URL), the scenario, both stopped."""
    if not db.startswith("postgresql"):
        raise MissingServerSupport(
            "failover scenarios need --db postgresql://... (or none: a throwaway one)"
        )
    ports = [free_port(), free_port()]
    procs = []
    try:
        for port in ports:
            try:
                procs.append(start_server(db, port, "--advertise-url", f"http://127.0.0.1:{port}"))
            except RuntimeError as e:
                raise MissingServerSupport(
                    f"checkflow serve cannot run as a replica here: {e}"
                ) from e
        return asyncio.run(
            scenario(sc, [f"http://127.0.0.1:{p}" for p in ports], [p.pid for p in procs])
        )
    finally:
        for proc in procs:
            stop_server(proc)


def print_failover(results: list[FailoverResult]) -> None:
    print("scenario | jobs on the killed owner | detected | failover p50 s | p99 s | max s | "
          "committed checkpoints missing | heartbeat errors")  # fmt: skip
    for r in results:
        d = sorted(r.detect_s)
        p50 = f"{statistics.median(d):.2f}" if d else "-"
        top = f"{d[-1]:.2f}" if d else "-"
        print(f"{r.scenario.name} | {r.killed_jobs} | {len(d)}/{r.killed_jobs} | {p50} | "
              f"{pct(d, 99):.2f} | {top} | {r.missing_commits} | {r.heartbeat_errors}")  # fmt: skip
