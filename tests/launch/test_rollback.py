"""``checkflow restore --coordinator URL --job J --step N`` rolls a job running under
``checkflow run`` back: its ranks abort, the agent restarts them (without using one of
``--max-restarts``), they restore step N and train on to the end, bitwise equal to an
uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from checkflow.catalog import scan
from checkflow.protocol import CheckpointList, CheckpointStatus, paths
from checkflow.storage import Storage
from tests.launch._nodes import (
    create_job,
    events,
    fail,
    lines,
    reference_states,
    start_node,
    wait_for,
)
from tests.support.coordinator import AUTH, TOKEN, ServerProcess

STEPS = 30
GATE = 22
"""The ranks wait after this step until the test releases them: the roll-back comes there."""
ROLL_BACK_TO = 10


def committed(url: str, job: str) -> set[int]:
    """Steps the coordinator knows as committed."""
    r = httpx.get(url + paths.path(paths.CHECKPOINTS, job=job), headers=AUTH, timeout=5)
    if r.status_code == 404:
        return set()
    r.raise_for_status()
    checkpoints = CheckpointList.model_validate_json(r.content).checkpoints
    return {c.step for c in checkpoints if c.status == CheckpointStatus.COMMITTED}


def test_restore_with_coordinator_rolls_a_running_job_back_and_it_ends_bitwise_equal(
    tmp_path: Path, coordinator: ServerProcess
):
    reference = reference_states(tmp_path, STEPS)
    job, gate = "rollback", tmp_path / "gate"
    create_job(coordinator.url, TOKEN, job, 2, heartbeat_timeout_s=5.0)
    launcher = ["--standalone", "--nproc-per-node=2", "--monitor-interval=0.1"]
    # No restart to spare: a roll-back must not need one.
    launcher += ["--max-restarts=0", "--coordinator", coordinator.url, "--job", job]
    launcher += ["--token", TOKEN]
    args = ["--dir", str(tmp_path / "ckpt"), "--steps", str(STEPS), "--kill-at", "1000000"]
    args += ["--events", str(tmp_path), "--gate", f"{GATE}:{gate}"]
    node = start_node(tmp_path, "A", launcher, args)
    try:
        wait_for(
            f"both ranks past step {GATE} with step 20 committed",
            lambda: (
                len(lines(events(tmp_path), "gate")) == 2 and 20 in committed(coordinator.url, job)
            ),
            150,
            [node],
        )
        cmd = [sys.executable, "-m", "checkflow.cli", "restore", "--coordinator"]
        cmd += [coordinator.url, "--job", job, "--step", str(ROLL_BACK_TO), "--token", TOKEN]
        rolled = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert rolled.returncode == 0, rolled.stderr
        assert f"job {job} rolled back to step {ROLL_BACK_TO}" in rolled.stdout

        wait_for(
            f"both ranks restarted from step {ROLL_BACK_TO}",
            lambda: (
                sum(s == str(ROLL_BACK_TO) for _, _, s in lines(events(tmp_path), "start")) == 2
            ),
            150,
            [node],
        )
        gate.touch()
        if node.wait(150) != 0:
            fail(f"the job did not finish (exit {node.proc.returncode})", [node])
    finally:
        if node.proc.poll() is None or node.workers():
            node.kill()

    starts = sorted(lines(events(tmp_path), "start"))
    # Round 0 twice: the restart after the roll-back used none of --max-restarts (0).
    assert starts == [["0", "0", "0"], ["0", "0", "10"], ["1", "0", "0"], ["1", "0", "10"]]
    trained = {(r, s) for r, _, s, _ in lines(events(tmp_path), "step")}
    assert ("0", str(STEPS)) in trained and ("1", str(STEPS)) in trained
    states = dict(lines(events(tmp_path), "state"))
    assert states == reference, "parameters and optimizer state equal an uninterrupted run's"
    assert "restarting them without using one of --max-restarts" in node.output()
    # The steps taken again after the roll-back went to timeline 1's own folders (issue 30).
    root = tmp_path / "ckpt"
    record = json.loads((root / "TIMELINE-1.json").read_bytes())
    assert record == {"timeline": 1, "parent": 0, "forked_at": ROLL_BACK_TO}
    names = scan(Storage(str(root))).names
    assert max(names) == STEPS and names[STEPS].endswith(".t1")
    assert all(name.endswith(".t1") for step, name in names.items() if step > ROLL_BACK_TO)
