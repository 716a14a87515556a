"""How ``checkflow run`` ends a job at the coordinator: Ctrl-C stops it (``stopped``), and
a launcher out of restarts fails it (``failed``), instead of leaving it ``recovering`` for
good. Real launcher, a real gloo worker (``_ddp_job.py``, one rank: the launcher's end is the
point, not the collectives), a real ``checkflow serve``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow.protocol import RankState
from tests.launch._nodes import create_job, events, fail, gated_job_args, lines, start_node
from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.net import wait_until

pytestmark = pytest.mark.slow


def launcher_options(coordinator: ServerProcess, job: str, restarts: int) -> list[str]:
    options = ["--standalone", "--nproc-per-node=1", "--monitor-interval=0.1"]
    options += [f"--max-restarts={restarts}", "--coordinator", coordinator.url, "--job", job]
    return options + ["--token", TOKEN]


def status_state(coordinator: ServerProcess, job: str) -> str:
    """The STATE column of ``job``'s row in ``checkflow status URL``."""
    env = {**os.environ, "CHECKFLOW_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "checkflow.cli", "status", coordinator.url]
    shown = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    (row,) = [r.split() for r in shown.stdout.splitlines()[1:] if r.split()[0] == job]
    return row[1]


def test_ctrl_c_on_checkflow_run_stops_the_job(tmp_path: Path, coordinator: ServerProcess):
    create_job(coordinator.url, TOKEN, "interrupted", 1, heartbeat_timeout_s=5.0)
    gate = tmp_path / "never"
    args = gated_job_args(tmp_path, steps=30, gate_step=3, gate=gate)
    node = start_node(tmp_path, "A", launcher_options(coordinator, "interrupted", 3), args)
    workers: list[int] = []
    try:
        wait_until(lambda: lines(events(tmp_path), "gate"), 150, "the rank training")
        assert coordinator.job("interrupted").state == "running"
        workers = node.workers()
        node.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
        rc = node.wait(60)
        if rc != 130:
            fail(f"checkflow run did not stop on SIGINT with 130 (rc {rc})", [node])
    finally:
        for pid in workers:  # torch's workers are in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if node.proc.poll() is None:
            node.kill()
    job = coordinator.job("interrupted")
    assert (job.state, job.recovering, job.ranks_alive, job.generation) == ("stopped", False, 0, 1)
    # Nobody is watched any more: no silence can start a generation and "recover" it.
    assert {r.state for r in coordinator.ranks("interrupted")} == {RankState.ABORTED}
    (stop,) = [e for e in coordinator.events("interrupted") if e.kind == "job_stopped"]
    assert (stop.detail["reason"], stop.detail["state"]) == ("interrupted", "stopped")
    assert status_state(coordinator, "interrupted") == "stopped"


def test_a_launcher_out_of_restarts_fails_the_job(tmp_path: Path, coordinator: ServerProcess):
    create_job(coordinator.url, TOKEN, "gave-up", 1, heartbeat_timeout_s=5.0)
    args = ["--dir", str(tmp_path / "ckpt"), "--steps", "30", "--events", str(tmp_path)]
    args += ["--fault", "0:0:7:kill"]  # rank 0 SIGKILLs itself after step 7, round 0
    node = start_node(tmp_path, "A", launcher_options(coordinator, "gave-up", 0), args)
    if node.wait(150) in (None, 0):
        fail("checkflow run should fail: its worker died with no restart left", [node])
    job = coordinator.job("gave-up")
    assert (job.state, job.recovering, job.ranks_alive) == ("failed", False, 0)
    seen = coordinator.events("gave-up")
    crash = [e for e in seen if e.kind == "rank_failed" and e.detail["kind"] == "crash"]
    assert [e.rank for e in crash] == [0]  # the launcher reported it, then gave up
    ends = [e for e in seen if e.kind in ("generation_started", "job_stopped")]
    assert [e.kind for e in ends] == ["generation_started", "job_stopped"]
    stop = ends[-1]
    assert (stop.detail["reason"], stop.detail["state"]) == ("gave_up", "failed")
    assert "ChildFailedError" in str(stop.detail["detail"])
    assert status_state(coordinator, "gave-up") == "failed"
