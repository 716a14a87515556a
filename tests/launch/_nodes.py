"""Simulated nodes for the launcher tests: one ``checkflow run`` agent each, on this machine.

Two agents with c10d rendezvous on 127.0.0.1 stand in for two nodes. torch starts every
worker in a session of its own, so a node is its agent and the agent's descendants, found
in ``/proc``; killing a node kills all of them at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from checkflow.launch.warmstart import SPARE_NAME
from checkflow.protocol import JobCreate, paths

JOB = Path(__file__).with_name("_ddp_job.py")


@dataclass
class Node:
    """One agent process and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path

    def processes(self) -> list[int]:
        """The agent and every descendant (its workers), agent first."""
        return [self.proc.pid, *descendants(self.proc.pid)]

    def workers(self) -> list[int]:
        """The agent's descendants but its waiting warm spares (named ``SPARE_NAME``)."""
        return [p for p in descendants(self.proc.pid) if process_name(p) != SPARE_NAME]

    def kill(self) -> None:
        """SIGKILL the agent and its workers together, as a node that loses power."""
        for pid in reversed(self.processes()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float) -> int | None:
        """The agent's exit status, or None (then the node is killed) after ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def output(self) -> str:
        return self.out.read_text(errors="replace")


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (children first), from ``/proc/*/stat``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def start_node(
    tmp_path: Path,
    name: str,
    launcher: list[str],
    job: list[str],
    env: dict[str, str] | None = None,
) -> Node:
    """``checkflow run LAUNCHER _ddp_job.py JOB`` in a session of its own."""
    cmd = [sys.executable, "-m", "checkflow.cli", "run", *launcher, str(JOB), *job]
    out = tmp_path / f"node-{name}.out"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Node(name, proc, out)


def two_node_options(rdzv_port: int, job: str, coordinator_url: str, token: str) -> list[str]:
    """``checkflow run``'s options for one of two stand-in nodes of ``job``: one rank each,
    c10d rendezvous on 127.0.0.1, three restarts, reporting to the coordinator."""
    options = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d"]
    options += [f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", f"--rdzv-id={job}"]
    options += ["--max-restarts=3", "--monitor-interval=0.1"]
    return options + ["--coordinator", coordinator_url, "--job", job, "--token", token]


def gated_job_args(tmp_path: Path, steps: int, gate_step: int, gate: Path) -> list[str]:
    """``_ddp_job.py``'s arguments for a run of ``steps`` that waits after ``gate_step``
    until ``gate`` exists (the test's fault comes there) and never kills itself."""
    args = ["--dir", str(tmp_path / "ckpt"), "--steps", str(steps)]
    args += ["--events", str(tmp_path), "--kill-at", "1000000"]
    return args + ["--gate", f"{gate_step}:{gate}"]


def wait_for_port(port: int, node: Node, timeout: float = 30) -> None:
    """Until something listens on ``port`` (the node's rendezvous store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert node.proc.poll() is None, f"node {node.name} exited:\n{node.output()[-3000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def create_job(
    url: str, token: str, name: str, world_size: int, heartbeat_timeout_s: float
) -> None:
    """Create the job before its ranks do, with a short heartbeat timeout (the ranks'
    registrations then find it and keep its settings)."""
    body = JobCreate(
        name=name,
        world_size=world_size,
        heartbeat_timeout_s=heartbeat_timeout_s,
        hang_timeout_s=60.0,  # the tests' gates hold the ranks still for seconds on purpose
    )
    r = httpx.post(
        url + paths.path(paths.JOBS),
        json=body.model_dump(mode="json", exclude_none=True),
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    r.raise_for_status()


def events(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in sorted(tmp_path.glob("rank-*.log")))


def lines(text: str, kind: str) -> list[list[str]]:
    return [line.split()[1:] for line in text.splitlines() if line.startswith(kind + " ")]


def wait_for(what: str, check, timeout: float, nodes: list[Node]) -> None:  # noqa: ANN001
    """Until ``check()``; fails with the nodes' output tails when it does not come."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    fail(f"{what} did not happen within {timeout} s", nodes)


def fail(message: str, nodes: list[Node]) -> None:
    tails = "\n".join(f"--- node {n.name}:\n{n.output()[-4000:]}" for n in nodes)
    pytest.fail(f"{message}\n{tails}")


_REFERENCES: dict[int, dict[str, str]] = {}


def reference_states(tmp_path: Path, steps: int) -> dict[str, str]:
    """The ``state`` digests of an uninterrupted 2-rank run of the same job (run once per
    test session and number of steps)."""
    if steps not in _REFERENCES:
        _REFERENCES[steps] = _run_reference(tmp_path, steps)
    return _REFERENCES[steps]


def _run_reference(tmp_path: Path, steps: int) -> dict[str, str]:
    folder = tmp_path / "reference"
    folder.mkdir()
    node = start_node(
        folder,
        "ref",
        ["--standalone", "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.1"],
        ["--dir", str(folder / "ckpt"), "--steps", str(steps), "--kill-at", "1000000"]
        + ["--events", str(folder)],
        env={"CHECKFLOW_COORDINATOR": "", "CHECKFLOW_JOB": ""},
    )
    if node.wait(150) != 0:
        fail("the uninterrupted reference run failed", [node])
    return {rank: digest for rank, digest in lines(events(folder), "state")}
