"""Two nodes under ``checkflow run`` (two agents, c10d rendezvous on 127.0.0.1), the real
coordinator, and a 2-rank gloo DDP job (one rank per node, ``exact`` mode). Each test
faults node B (the node that does not host the rendezvous store: when the host dies,
every other agent loses the rendezvous and exits, as under torchrun) and asserts that the
job ends with parameters and optimizer state bitwise equal to an uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from checkflow.catalog import committed_steps
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

STEPS = 30
GATE = 13
"""Both ranks wait after this step until the test releases them (the fault comes there)."""
HEARTBEAT_TIMEOUT_S = 3.0


class Cluster:
    """Node A (started first: it hosts the rendezvous store) and node B of one job."""

    def __init__(self, tmp_path: Path, server: ServerProcess, job: str) -> None:
        self.tmp_path, self.server, self.job = tmp_path, server, job
        self.port = free_port()
        self.gate = tmp_path / "gate"
        self.nodes: list[Node] = []
        create_job(server.url, TOKEN, job, 2, HEARTBEAT_TIMEOUT_S)

    def start(self, name: str) -> Node:
        launcher = two_node_options(self.port, self.job, self.server.url, TOKEN)
        job = gated_job_args(self.tmp_path, STEPS, GATE, self.gate)
        node = start_node(self.tmp_path, name, launcher, job)
        self.nodes.append(node)
        return node

    def start_both(self) -> tuple[Node, Node]:
        a = self.start("A")
        wait_for_port(self.port, a)  # A binds the store's port before B exists
        return a, self.start("B")

    def wait_at_gate_with_step_10_committed(self) -> None:
        storage = Storage(str(self.tmp_path / "ckpt"))
        wait_for(
            "both ranks at the gate, step 10 committed",
            lambda: (
                len(lines(events(self.tmp_path), "gate")) == 2
                and max(committed_steps(storage), default=0) >= 10
            ),
            150,
            self.nodes,
        )

    def finish(self, *nodes: Node) -> None:
        for node in nodes:
            if node.wait(150) != 0:
                fail(f"node {node.name} did not finish (exit {node.proc.returncode})", self.nodes)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None or node.workers():
                node.kill()


@pytest.fixture
def cluster(tmp_path: Path, coordinator: ServerProcess, request: pytest.FixtureRequest):
    c = Cluster(tmp_path, coordinator, request.node.name[:60].replace("[", "-").strip("]"))
    yield c
    c.close()


def resumed(tmp_path: Path) -> dict[str, list[int]]:
    """Each rank's start steps, in order."""
    starts: dict[str, list[int]] = {}
    for rank, _round, step in lines(events(tmp_path), "start"):
        starts.setdefault(rank, []).append(int(step))
    return starts


def test_frozen_rank_on_node_b_is_killed_and_both_nodes_resume_bitwise_equal(cluster, reference):
    a, b = cluster.start_both()
    cluster.wait_at_gate_with_step_10_committed()
    # torch's c10d backend: an agent whose host matches --rdzv-endpoint tries to host the
    # rendezvous store; the first to bind the port does (A), the other connects to it.
    assert [n.name for n in (a, b) if _listens_on(n.proc.pid, cluster.port)] == ["A"]
    (frozen,) = b.workers()
    os.kill(frozen, signal.SIGSTOP)
    frozen_at = time.time()
    cluster.gate.touch()

    cluster.finish(a, b)

    assert not _alive(frozen), "node B's agent killed its frozen worker"
    # ... because the coordinator said so (not torch's membership change: A rejoining)
    assert "local rank(s) [1] of an older generation are still running (declared failed)" in (
        b.output()
    )
    assert resumed(cluster.tmp_path) == {"0": [0, 10], "1": [0, 10]}
    states = dict(lines(events(cluster.tmp_path), "state"))
    assert states == reference, "parameters and optimizer state equal an uninterrupted run's"
    steps = lines(events(cluster.tmp_path), "step")
    again = min(float(t) for _, _, s, t in steps if s == "11" and float(t) > frozen_at)
    print(f"freeze -> training again: {again - frozen_at:.1f} s")


def test_node_b_killed_whole_and_started_again_rejoins_and_the_job_ends_bitwise_equal(
    cluster, reference
):
    a, b = cluster.start_both()
    cluster.wait_at_gate_with_step_10_committed()
    b.kill()  # its agent and its worker, together
    cluster.gate.touch()
    b2 = cluster.start("B2")

    cluster.finish(a, b2)

    assert resumed(cluster.tmp_path) == {"0": [0, 10], "1": [0, 10]}
    states = dict(lines(events(cluster.tmp_path), "state"))
    assert states == reference, "parameters and optimizer state equal an uninterrupted run's"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a socket listening on ``port`` (from /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
                return True
    return False
