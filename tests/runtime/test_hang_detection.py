"""Hangs found from progress, end to end: the real coordinator (``checkflow serve`` in a
subprocess), two real gloo ranks as plain processes, a real ``Checkpointer`` in each.

A rank stuck in Python keeps its heartbeat thread alive, so liveness cannot see it; its
step stands still, and the coordinator declares it hung and tells every rank to abort,
which their heartbeat threads do (exit 75) even while the main thread spins or blocks in
a gloo collective. A rank in ``ckpt.paused()`` is not hung, nor is the rank waiting for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkflow.client import ABORT_EXIT_CODE
from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).with_name("_hang_worker.py")
ROOT = Path(__file__).resolve().parents[2]
SERVER_HANG_TIMEOUT_S = 3.0
"""``checkflow serve --hang-timeout``: the stuck job sets none of its own."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(
        tmp_path / "coordinator.db", options=("--hang-timeout", str(SERVER_HANG_TIMEOUT_S))
    )
    s.start()
    yield s
    s.stop()


def start_ranks(
    server: ServerProcess, tmp_path: Path, job: str, *args: str
) -> list[subprocess.Popen[str]]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": str(ROOT),
        }
        cmd = [sys.executable, str(WORKER), "--dir", str(tmp_path / job), "--url", server.url]
        cmd += ["--job", job, "--token", TOKEN, *args]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def read_until(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first stdout line of ``proc`` starting with ``prefix``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line; exit {proc.poll()}, stderr:\n{stderr_of(proc)}")


def stderr_of(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    assert proc.stderr is not None
    return proc.stderr.read()[-3000:]


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[int]:
    """Every process's exit code, waiting until ``timeout`` seconds from now; the ones
    still running then are killed and reported as None-like failures (-9)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def events(server: ServerProcess, job: str) -> list[dict]:
    with server.http() as http:
        return http.get(f"/v1/jobs/{job}/events").json()["events"]


def test_a_rank_stuck_in_python_and_one_blocked_in_all_reduce_both_exit_75(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    procs = start_ranks(server, tmp_path, "stuck", "--mode", "stuck")
    try:
        for p in procs:
            read_until(p, "stuck", timeout=120)
        stuck_at = time.monotonic()
        # hang timeout + up to a heartbeat before the coordinator saw the last step + a
        # detector sweep + up to a heartbeat until the abort reply; slack for 2 busy cores.
        codes = finish(procs, timeout=SERVER_HANG_TIMEOUT_S + 6)
        took = time.monotonic() - stuck_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [ABORT_EXIT_CODE, ABORT_EXIT_CODE], [stderr_of(p) for p in procs]
    assert took >= SERVER_HANG_TIMEOUT_S - 1.0  # not before the timeout (minus a heartbeat)
    failed = [e for e in events(server, "stuck") if e["kind"] == "rank_failed"]
    assert failed and {e["detail"]["kind"] for e in failed} == {"hung"}
    assert all(
        SERVER_HANG_TIMEOUT_S <= e["detail"]["detection_s"] <= SERVER_HANG_TIMEOUT_S + 3
        for e in failed
    )
    assert "aborting (exit code 75)" in stderr_of(procs[1])

    from checkflow.cli import main

    assert main(["status", server.url, "stuck", "--token", TOKEN]) == 0
    recoveries = capsys.readouterr().out.split("GEN  FAULT")[-1].splitlines()
    assert recoveries[1].split()[:2] == ["2", "hung"]
    assert "recovering" in recoveries[1]  # nobody restarted the ranks


def test_a_rank_in_paused_is_not_hung_nor_the_rank_waiting_for_it(
    server: ServerProcess, tmp_path: Path
) -> None:
    hang_timeout = 2.0  # the job's own (Checkpointer(hang_timeout=)), below the server's
    args = ["--mode", "paused", "--steps", "15", "--hang-timeout", str(hang_timeout)]
    procs = start_ranks(server, tmp_path, "paused", *args, "--pause", str(3 * hang_timeout))
    try:
        codes = finish(procs, timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [stderr_of(p) for p in procs]
    with server.http() as http:
        job = http.get("/v1/jobs/paused").json()
        ranks = http.get("/v1/jobs/paused/ranks").json()["ranks"]
    assert (job["hang_timeout_s"], job["generation"], job["failures"]) == (hang_timeout, 1, 0)
    # Both trained on after the pause: the last step reported is one behind the 30 trained
    # (a step's progress goes out with the next step).
    assert [(r["state"], r["step"] >= 29) for r in ranks] == [("finished", True)] * 2
    assert not [e for e in events(server, "paused") if e["kind"] == "rank_failed"]
