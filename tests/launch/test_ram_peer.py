"""A whole node lost with its memory restores from its peer's copy of its RAM tier
(issue 11).

Two nodes under ``checkflow run --ram-tier`` (two agents, c10d rendezvous on 127.0.0.1,
one gloo DDP rank each), the real coordinator. The agents form a ring: each holds the
other's RAM-tier copies (``--ram-listen``) and sends its own (``--ram-peer``), over TCP on
127.0.0.1. Node B is SIGKILLed whole (agent and worker) once its step 10 is in node A's
memory, and its RAM-tier folder is deleted (the memory of a lost node); node B2, started
under B's name, fetches B's copies from A before its worker starts. Both ranks restore step
10 from RAM, with no read from storage, and end bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkflow.catalog import committed_steps
from checkflow.memory.area import node_area
from checkflow.storage import Storage
from tests.launch._nodes import (
    Node,
    create_job,
    events,
    fail,
    gated_job_args,
    lines,
    start_node,
    two_node_options,
    wait_for,
    wait_for_port,
)
from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 30
GATE = 13
JOB = "ram-peer"


@pytest.fixture
def shm() -> Iterator[Path]:
    root = Path("/dev/shm") / f"checkflow-test-{uuid.uuid4().hex[:12]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Ring:
    """Nodes A and B of one job; A holds B's copies and B holds A's."""

    def __init__(self, tmp_path: Path, server: ServerProcess, shm: Path) -> None:
        self.tmp_path, self.server, self.shm = tmp_path, server, shm
        self.rdzv, self.ports = free_port(), {"A": free_port(), "B": free_port()}
        self.gate = tmp_path / "gate"
        self.nodes: list[Node] = []
        create_job(server.url, TOKEN, JOB, 2, 3.0)

    def start(self, name: str, as_node: str) -> Node:
        other = "B" if as_node == "A" else "A"
        launcher = two_node_options(self.rdzv, JOB, self.server.url, TOKEN)
        launcher += ["--ram-tier", "--ram-root", str(self.shm)]
        launcher += ["--ram-listen", f"127.0.0.1:{self.ports[as_node]}"]
        launcher += ["--ram-peer", f"127.0.0.1:{self.ports[other]}"]
        job = gated_job_args(self.tmp_path, STEPS, GATE, self.gate)
        node = start_node(self.tmp_path, name, launcher, job, env={"CHECKFLOW_RAM_NODE": as_node})
        self.nodes.append(node)
        return node

    def area(self, node: str) -> Path:
        return Path(node_area(str(self.shm), JOB, node))

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None or node.workers():
                node.kill()


@pytest.fixture
def ring(tmp_path: Path, coordinator: ServerProcess, shm: Path) -> Iterator[Ring]:
    r = Ring(tmp_path, coordinator, shm)
    yield r
    r.close()


def test_node_killed_whole_with_its_memory_restores_from_its_peers_copy(ring, reference):
    a = ring.start("A", "A")
    wait_for_port(ring.rdzv, a)
    b = ring.start("B", "B")
    storage = Storage(str(ring.tmp_path / "ckpt"))
    # Which rank node B runs is the rendezvous' choice: find it from B's own RAM tier.
    wait_for("both ranks at the gate", lambda: len(lines(events(ring.tmp_path), "gate")) == 2,
             150, ring.nodes)  # fmt: skip
    (b_rank,) = [p.name for p in ring.area("B").iterdir() if p.name.startswith("rank-")]
    held = Storage(str(ring.area("A") / "peers" / "B" / b_rank))
    wait_for("B's step 10 in A's memory", lambda: 10 in committed_steps(held), 60, ring.nodes)
    # Storage is written after the RAM tier: its commit of 10 may come later.
    wait_for("step 10 committed", lambda: 10 in committed_steps(storage), 60, ring.nodes)

    b.kill()
    shutil.rmtree(ring.area("B"))  # the lost node's memory
    ring.gate.touch()
    b2 = ring.start("B2", "B")
    for node in (a, b2):
        if node.wait(240) != 0:
            fail(f"node {node.name} did not finish", ring.nodes)

    assert "files fetched from peer" in b2.output(), "B2 took B's copies back from A"
    starts: dict[str, list[int]] = {}
    tiers: dict[str, list[tuple[str, int]]] = {}
    for rank, _round, step in lines(events(ring.tmp_path), "start"):
        starts.setdefault(rank, []).append(int(step))
    for rank, _round, tier, reads in lines(events(ring.tmp_path), "tier"):
        tiers.setdefault(rank, []).append((tier, int(reads)))
    assert starts == {"0": [0, 10], "1": [0, 10]}, starts
    assert {r: t[1:] for r, t in tiers.items()} == {"0": [("ram", 0)], "1": [("ram", 0)]}, (
        "both ranks restored from node memory, without a read from storage"
    )
    states = dict(lines(events(ring.tmp_path), "state"))
    assert states == reference, "parameters and optimizer state equal an uninterrupted run's"
