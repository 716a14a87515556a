"""A job's life as a user sees it, end to end: a real ``checkflow serve``, real training
processes (``examples/train.py``, a Checkpointer with the coordinator) and the real CLI.

- A job that trains to its end is ``finished``, not a job with "no live ranks".
- A roll-back of the finished job leaves its checkpoints committed (they are on storage and
  verify); launched again, it restores the step rolled back to and writes the later steps
  anew.
- ``checkflow status --limit 6`` lists the job's recovery although more than 6 events came
  after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow.catalog import committed_steps
from checkflow.protocol import JobCreate
from checkflow.storage import Storage
from tests.dashboard.api_ranks import ApiRanks
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.net import wait_until
from tests.support.paths import REPO

pytestmark = pytest.mark.slow

TRAIN = REPO / "examples" / "train.py"


def cli(*args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    """``checkflow ARGS`` as a user runs it, with the token in the environment."""
    env = {**os.environ, "CHECKFLOW_TOKEN": token}
    cmd = [sys.executable, "-m", "checkflow.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def train(server: ServerProcess, job: str, folder: Path, steps: int) -> str:
    """``examples/train.py`` to ``steps`` with the coordinator; its output."""
    env = {**os.environ, "CHECKFLOW_TOKEN": TOKEN}
    cmd = [sys.executable, str(TRAIN), "--dir", str(folder), "--steps", str(steps)]
    cmd += ["--every", "10", "--keep", "0", "--coordinator", server.url, "--job", job]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def on_storage(folder: Path) -> list[int]:
    """The committed steps in ``folder`` (``MANIFEST.json``), as ``checkflow ls`` lists them."""
    return list(committed_steps(Storage(str(folder))))


def labels(server: ServerProcess, job: str) -> dict[int, str]:
    return {c.step: str(c.status) for c in server.checkpoints(job)}


def status_row(server: ServerProcess, job: str) -> list[str]:
    """The job's row in ``checkflow status URL``."""
    shown = cli("status", server.url)
    assert shown.returncode == 0, shown.stderr
    header, *rows = shown.stdout.splitlines()
    assert header.split()[:2] == ["JOB", "STATE"]
    (row,) = [r.split() for r in rows if r.split()[0] == job]
    return row


def changes(server: ServerProcess, job: str) -> int:
    """How many times the coordinator changed ``job``'s interval."""
    return [e.kind for e in server.events(job)].count("interval_changed")


def wait_for_changes(server: ServerProcess, job: str, count: int) -> None:
    wait_until(lambda: changes(server, job) >= count, 20, f"{count} interval changes")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One coordinator for the module, retuning often (the status test needs interval
    changes within seconds)."""
    db = tmp_path_factory.mktemp("lifecycle") / "coordinator.db"
    with served(db, CHECKFLOW_RETUNE_PERIOD_S="0.1") as s:
        yield s


def test_a_finished_job_is_finished_and_a_roll_back_keeps_its_commits_committed(
    server: ServerProcess, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    train(server, "demo", folder, steps=30)
    job = server.job("demo")
    assert (job.state, job.ranks_alive, job.recovering, job.generation) == ("finished", 0, False, 1)
    assert status_row(server, "demo")[1] == "finished"
    assert [e.kind for e in server.events("demo")][-1] == "job_finished"
    steps = on_storage(folder)
    assert steps == sorted(labels(server, "demo")) and len(steps) >= 3
    assert set(labels(server, "demo").values()) == {"committed"}

    back_to = steps[0]
    rolled = cli("restore", "--coordinator", server.url, "--job", "demo", "--step", str(back_to))
    assert rolled.returncode == 0, rolled.stderr
    assert f"job demo rolled back to step {back_to}: generation 2" in rolled.stdout
    # Still on storage and whole: still committed; the restore point is the step asked for.
    assert labels(server, "demo") == dict.fromkeys(steps, "committed")
    verified = cli("verify", str(folder), "--all")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    job = server.job("demo")
    assert (job.state, job.restore_step, job.generation) == ("finished", back_to, 2)

    # Launched again, it leaves the later steps' timeline: restores the step and retrains.
    out = train(server, "demo", folder, steps=30)
    assert f"start step {back_to}" in out
    job = server.job("demo")
    assert (job.state, job.generation, job.restore_step) == ("finished", 2, steps[-1])
    assert labels(server, "demo") == dict.fromkeys(steps, "committed")
    assert {c.step: c.generation for c in server.checkpoints("demo")} == {
        s: 1 if s <= back_to else 2 for s in steps
    }
    assert on_storage(folder) == steps


def test_status_limit_6_lists_the_recovery_that_more_than_6_events_followed(
    server: ServerProcess,
) -> None:
    server.create_job(
        JobCreate(name="tuned", world_size=2, heartbeat_timeout_s=300, hang_timeout_s=600)
    )
    with server.http() as http:
        ranks = ApiRanks(http, "tuned", 2)
        ranks.register()
        ranks.heartbeat(10, iteration_s=0.5, stall_s=0.1)
        ranks.checkpoint(10, 1000)
        ranks.crash(1, seconds_ago=0.2)  # the recovery: generation 2
        ranks.register()
        ranks.heartbeat(20, iteration_s=0.5, stall_s=0.1)  # trained past step 10 again
        # Then interval changes, one after the other (the step runs past each change).
        before, step = changes(server, "tuned"), 20
        for n, stall in enumerate((0.4, 0.02, 0.4, 0.02, 0.4), start=1):
            step += 10_000
            ranks.heartbeat(step, iteration_s=0.5, stall_s=stall)
            wait_for_changes(server, "tuned", before + n)
    kinds = [e.kind for e in server.events("tuned")]
    after = kinds[kinds.index("generation_started") + 1 :]
    assert len(after) > 6 and "generation_started" not in after

    shown = cli("status", server.url, "tuned", "--limit", "6")
    assert shown.returncode == 0, shown.stderr
    assert "no recoveries" not in shown.stdout
    table = shown.stdout.split("\nGEN ")[1].splitlines()[1:]
    assert [r.split()[:3] for r in table] == [["2", "crash", "1"]]
