"""The launcher and the coordinator work unchanged for an XLA job.

An XLA:CPU training run (``_xla_train.py``) under ``checkflow run`` (the real launcher) with
a real coordinator (the uvicorn app of ``checkflow serve``, in a thread of the test: a
subprocess would import it again, which under this machine's load can take longer than its
start timeout): its heartbeats and step times
reach the coordinator, its worker SIGKILLs itself once, the launcher's agent reports the
crash and starts a new worker, which resumes from the newest checkpoint and ends bitwise
equal to a run that never stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from checkflow.protocol import (
    CheckpointList,
    CheckpointStatus,
    EventList,
    JobPublic,
    RankList,
    RankState,
    paths,
)
from tests.launch._nodes import create_job
from tests.runtime._train import assert_bitwise_equal, load_final, run_train
from tests.support.coordinator import TOKEN, ThreadServer
from tests.support.net import free_port

TRAIN = Path(__file__).with_name("_xla_train.py")
JOB = "xla-launch"
STEPS, EVERY, KILL_AT = 10, 3, 7
XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}


def _launch(tmp_path: Path, url: str) -> str:
    """``checkflow run`` to success; returns its output (the worker's lines included)."""
    cmd = [sys.executable, "-m", "checkflow.cli", "run", "--nproc-per-node=1"]
    # A free port for the rendezvous: torch's default 29500 may be taken by another job here.
    cmd += ["--max-restarts=2", "--monitor-interval=0.1", f"--master-port={free_port()}"]
    cmd += ["--coordinator", url, "--job", JOB, "--token", TOKEN]
    cmd += [str(TRAIN), "--dir", str(tmp_path / "run"), "--steps", str(STEPS)]
    cmd += ["--every", str(EVERY), "--kill-at", str(KILL_AT), "--out", str(tmp_path / "b.pt")]
    output = tmp_path / "launcher.out"
    with output.open("w") as out:
        # Its own session: on a timeout the launcher and its worker are killed together.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **XLA_ENV},
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=420)  # a guard against hangs: about a minute here
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    text = output.read_text()
    assert rc == 0, (
        f"checkflow run {'timed out' if rc is None else f'exited {rc}'}:\n{text[-4000:]}"
    )
    return text


def test_xla_job_under_checkflow_run_reports_to_coordinator_recovers_from_sigkill_bitwise(
    tmp_path: Path,
) -> None:
    common = ["--steps", str(STEPS), "--every", str(EVERY)]
    run_train(
        "--dir", str(tmp_path / "straight"), *common, "--out", str(tmp_path / "a.pt"),
        env=XLA_ENV, script=TRAIN, timeout=420,
    )  # fmt: skip

    server = ThreadServer(tmp_path / "coordinator.db", free_port())
    server.start()
    try:
        create_job(server.url, TOKEN, JOB, 1, heartbeat_timeout_s=60.0)
        out = _launch(tmp_path, server.url)
        job = JobPublic.model_validate(server.get(paths.path(paths.JOB, job=JOB)))
        ranks = RankList.model_validate(server.get(paths.path(paths.RANKS, job=JOB))).ranks
        reply = server.get(paths.path(paths.CHECKPOINTS, job=JOB))
        checkpoints = CheckpointList.model_validate(reply).checkpoints
        events = EventList.model_validate(server.get(paths.path(paths.EVENTS, job=JOB))).events
    finally:
        server.stop()

    restored = [int(line.split()[-1]) for line in out.splitlines() if "restored " in line]
    assert restored == [0, 6], f"one restart, from the newest checkpoint before step 7:\n{out}"
    assert f"killing myself after step {KILL_AT}" in out

    # The agent reported the SIGKILL as a crash (not the heartbeat timeout, 60 s here).
    failed = [e for e in events if e.kind == "rank_failed"]
    assert [(e.rank, e.detail["kind"]) for e in failed] == [(0, "crash")], failed
    assert "exit code -9" in str(failed[0].detail["reason"])
    assert job.generation >= 2, "the recovery started a new generation"
    assert job.failures == 1

    # The second round registered in the new generation, reported progress past the step it
    # restored (heartbeats carry the step) and its step time, and finished.
    (rank,) = ranks
    assert rank.generation == job.generation and rank.state == RankState.FINISHED
    assert 6 < rank.step <= STEPS and rank.last_heartbeat is not None
    assert rank.iteration_s is not None and rank.iteration_s > 0
    committed = sorted(c.step for c in checkpoints if c.status == CheckpointStatus.COMMITTED)
    assert {3, 6, 9} <= set(committed), committed

    a, b = load_final(tmp_path / "a.pt"), load_final(tmp_path / "b.pt")
    assert_bitwise_equal(a, b)
    assert a["xla_rng"] == b["xla_rng"]
