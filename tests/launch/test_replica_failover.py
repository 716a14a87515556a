"""A real job under ``checkflow run`` reporting to two coordinator replicas on one real
PostgreSQL (issue 33): the replica that serves the job is SIGKILLed mid-run, the other
takes the job over, training goes on, and a rank crash injected after the failover is
detected and recovered by the new owner, bitwise exact; a roll-back sent to the replica
that does not serve the job is redirected to the one that does.

Real parts only: ``checkflow run`` (torch's elastic agent) with the 2 gloo DDP ranks of
``_ddp_job.py``, two ``checkflow serve`` processes on a PostgreSQL cluster from Debian's
package (``tests/support/postgres.py``), the clients given both URLs (``--coordinator
A,B``). The failover's own timing is measured by ``benchmarks/coordinator.py``; the bounds
here are loose safety nets for a loaded 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from checkflow.protocol import CheckpointStatus, JobCreate, paths
from tests.support.coordinator import AUTH, TOKEN, ServerProcess
from tests.support.jobs import LaunchedJob, launch
from tests.support.net import wait_until
from tests.support.postgres import Cluster
from tests.support.replicas import replicas

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 30
RUN_TIMEOUT_S = 420
WAIT_S = 120
TAKEOVER_S = 60
"""Safety net for "another replica serves the job": the lease is 10 s (issue 33: <= 15 s,
measured by benchmarks/coordinator.py --scenarios failover); a loaded machine is slower."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Digest of the final parameters and optimizer state of the job run without a fault."""
    folder = tmp_path_factory.mktemp("reference")
    job = launch(folder, "--dir", str(folder / "ckpt"), "--steps", str(STEPS), "--kill-at", "99")
    events = job.finish(RUN_TIMEOUT_S)
    assert events.rounds == [0] and events.states[0] == events.states[1]
    return events.states[0]


@pytest.fixture
def pair(postgres_cluster: Cluster) -> Iterator[list[ServerProcess]]:
    """Replicas ``a`` and ``b`` of a new database; both may list the jobs' local storage."""
    with replicas(postgres_cluster.new_database(), 2, "--storage-allow", "file") as both:
        yield both


def serves(replica: ServerProcess, job: str) -> bool:
    """``replica`` answers for ``job`` itself (200), rather than redirecting (307)."""
    try:
        r = httpx.get(replica.url + paths.path(paths.JOB, job=job), headers=AUTH, timeout=5)
    except httpx.TransportError:
        return False
    return r.status_code == 200


def start(folder: Path, urls: str, job: str, *job_args: str) -> LaunchedJob:
    launcher = ("--max-restarts=3", "--coordinator", urls, "--job", job, "--token", TOKEN)
    args = ("--dir", str(folder / "ckpt"), "--steps", str(STEPS), "--kill-at", "99", *job_args)
    return launch(folder, *args, launcher_args=launcher)


def committed(replica: ServerProcess, job: str) -> set[int]:
    checkpoints = replica.checkpoints(job)
    return {c.step for c in checkpoints if c.status == CheckpointStatus.COMMITTED}


def test_owner_sigkilled_mid_run_the_other_replica_takes_the_job_and_recovers_a_crash_exactly(
    tmp_path: Path, pair: list[ServerProcess], reference: str
) -> None:
    a, b = pair
    name = "failover"
    a.create_job(JobCreate(name=name, world_size=2, heartbeat_timeout_s=6.0))
    assert serves(a, name) and not serves(b, name), "a created it, so a serves it"
    down = tmp_path / "owner-down"
    # Rank 1 is SIGKILLed at step 17 of round 0: after the failover, so the new owner must
    # detect it and drive the recovery. The gate holds step 12 until a is dead.
    job = start(
        tmp_path, f"{a.url},{b.url}", name,
        "--gate", f"12:{down}", "--fault", "0:1:17:kill", "--hang-timeout", "600",
    )  # fmt: skip
    job.wait_for(lambda e: {(0, 0, 12), (1, 0, 12)} <= e.gates, WAIT_S, "both ranks at 12")
    wait_until(lambda: a.job(name).restore_step == 10, WAIT_S, "step 10 committed")
    before = a.job(name)

    a.kill()
    killed = time.monotonic()
    wait_until(lambda: serves(b, name), TAKEOVER_S, "b serves the job")
    print(f"b served the job {time.monotonic() - killed:.1f} s after a's SIGKILL")
    taken = b.job(name)
    assert (taken.generation, taken.restore_step) == (before.generation, 10)
    assert {5, 10} <= committed(b, name), "the commits a had recorded"
    down.touch()

    events = job.finish(RUN_TIMEOUT_S)
    assert events.rounds == [0, 1], "one restart: the crash at step 17"
    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 15
    assert events.states == {0: reference, 1: reference}, "bitwise equal to no fault"
    failed = [(e.rank, e.detail["kind"]) for e in b.events(name) if e.kind == "rank_failed"]
    assert any(rank == 1 for rank, _ in failed), f"b recorded no failure of rank 1: {failed}"
    final = b.job(name)
    assert final.generation == before.generation + 1 and final.restore_step == STEPS
    assert set(range(5, STEPS + 1, 5)) <= committed(b, name), "no committed step missing"


def test_a_roll_back_sent_to_the_replica_that_does_not_serve_the_job_rolls_it_back(
    tmp_path: Path, pair: list[ServerProcess], reference: str
) -> None:
    a, b = pair
    name, gate = "rollback-via-b", tmp_path / "gate"
    a.create_job(JobCreate(name=name, world_size=2, heartbeat_timeout_s=6.0))
    job = start(tmp_path, f"{a.url},{b.url}", name, "--gate", f"22:{gate}")
    job.wait_for(lambda e: {(0, 0, 22), (1, 0, 22)} <= e.gates, WAIT_S, "both ranks at 22")
    wait_until(lambda: 20 in committed(a, name), WAIT_S, "step 20 committed")

    # b is listed first: it answers 307 to a, and the CLI follows it with its token.
    cmd = [sys.executable, "-m", "checkflow.cli", "restore", "--coordinator", f"{b.url},{a.url}"]
    cmd += ["--job", name, "--step", "10", "--token", TOKEN]
    rolled = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert rolled.returncode == 0, rolled.stderr
    assert f"job {name} rolled back to step 10" in rolled.stdout
    assert serves(a, name) and not serves(b, name), "the roll-back did not move the job"

    # A roll-back restarts the ranks in the same round (it uses none of --max-restarts).
    restarted = {(0, 0): 10, (1, 0): 10}
    job.wait_for(lambda e: e.starts == restarted, WAIT_S, "both ranks restarted from 10")
    gate.touch()
    events = job.finish(RUN_TIMEOUT_S)
    assert events.starts == restarted
    assert events.states == {0: reference, 1: reference}, "bitwise equal to no roll-back"
