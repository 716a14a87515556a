"""Faults injected into a real job, each recovered and ending bitwise exact (issue 10).

Real parts only: ``checkflow run`` (torch's elastic agent) starting the 2 gloo DDP ranks of
``_ddp_job.py`` (30 steps, a checkpoint every 5, ``exact`` codec), the real coordinator
(``checkflow serve`` on SQLite), and for one test S3 as moto behind a proxy that takes the
endpoint down. The job injects its faults in itself at a chosen step of a chosen round, once
the checkpoint before that step has committed (see ``_ddp_job.py``): a real SIGKILL, a real
SIGSTOP, a real busy loop. Every test ends with both ranks' parameters and optimizer state
bitwise equal to those of an uninterrupted run of the same job, and prints, for each fault,
the seconds from the fault to the next trained step and the steps redone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkflow.catalog import committed_steps, scan
from checkflow.protocol import CheckpointStatus, FaultKind, JobCreate
from checkflow.restore import CheckpointReader
from checkflow.storage import Storage
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.jobs import (
    INTERVAL,
    Events,
    LaunchedJob,
    Recovery,
    injected_recoveries,
    launch,
    recovery,
)
from tests.support.net import wait_until
from tests.support.s3 import FaultyS3Proxy, S3Location, s3_options

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 30
RUN_TIMEOUT_S = 420
"""A safety net, not a bound: a job with three restarts on a 2-core machine shared with
other work took 180 s; on an idle one each job takes well under a minute."""
RECOVERY_BOUND_S = 60
"""Loose: fault to the next trained step, per fault on the way (issue 10's targets are
measured by benchmarks/recovery.py)."""
HEARTBEAT_TIMEOUT_S = 4.0
"""Silence after which the coordinator declares a rank failed (ranks beat every second)."""
HANG_TIMEOUT_S = 4.0
"""``Checkpointer(hang_timeout=)``: a step standing still this long is a hang."""
WAIT_S = 120
"""Longest wait for an event of a run (a step, a commit): a safety net, not a bound."""


# --- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Digest of the final parameters and optimizer state of the job run without a fault."""
    folder = tmp_path_factory.mktemp("reference")
    no_fault = ("--kill-at", str(STEPS + 1))  # _ddp_job's own fault for test_run.py
    job = launch(folder, "--dir", str(folder / "ckpt"), "--steps", str(STEPS), *no_fault)
    events = job.finish(RUN_TIMEOUT_S)
    assert events.rounds == [0], "the reference run is uninterrupted"
    assert set(events.states) == {0, 1} and events.states[0] == events.states[1]
    return events.states[0]


@pytest.fixture(scope="module")
def coordinator(
    tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str
) -> Iterator[ServerProcess]:
    """One coordinator for the module; every test has a job of its own on it. It reaches
    moto directly (``AWS_ENDPOINT_URL_S3``, set by ``s3_endpoint``) to list commits."""
    with served(tmp_path_factory.mktemp("coordinator") / "coordinator.db") as server:
        yield server


# --- helpers --------------------------------------------------------------------------------
def start(
    folder: Path,
    coordinator: ServerProcess,
    job: str,
    *job_args: str,
    storage: str | None = None,
    env: dict[str, str] | None = None,
) -> LaunchedJob:
    """The job under ``checkflow run`` reporting to ``coordinator`` as ``job``."""
    launcher = ("--max-restarts=3", "--coordinator", coordinator.url, "--job", job)
    launcher += ("--token", TOKEN)
    where = storage or str(folder / "ckpt")
    # --kill-at is _ddp_job's own fault for test_run.py; here only the given ones happen.
    args = ("--dir", where, "--steps", str(STEPS), "--kill-at", str(STEPS + 1), *job_args)
    return launch(folder, *args, launcher_args=launcher, env=env)


def with_timeouts(coordinator: ServerProcess, job: str, **settings: float) -> None:
    """Create ``job`` before its ranks do, with settings the ranks do not send."""
    coordinator.create_job(JobCreate(name=job, world_size=2, **settings))


def assert_exact(events: Events, reference: str) -> None:
    assert events.states == {0: reference, 1: reference}, (
        "parameters and optimizer state differ from the uninterrupted run"
    )


def report(recoveries: list[Recovery]) -> list[Recovery]:
    """Print each recovery; check loose bounds: in time, and at most one interval redone."""
    for r in recoveries:
        print(r.line())
    for r in recoveries:
        assert 0 < r.seconds < RECOVERY_BOUND_S * r.faults, r.line()
        assert 0 <= r.redone <= INTERVAL, r.line()
    return recoveries


def committed(coordinator: ServerProcess, job: str) -> set[int]:
    """The steps the coordinator counts as committed for ``job``."""
    checkpoints = coordinator.checkpoints(job)
    return {c.step for c in checkpoints if c.status == CheckpointStatus.COMMITTED}


def failures(coordinator: ServerProcess, job: str) -> list[tuple[int | None, str]]:
    """(rank, fault kind) of every failure the coordinator declared for ``job``, in order."""
    events = coordinator.events(job)
    return [(e.rank, str(e.detail["kind"])) for e in events if e.kind == "rank_failed"]


# --- one fault per run ----------------------------------------------------------------------
def test_sigkilled_rank_restarts_and_the_job_ends_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    job = start(tmp_path, coordinator, "sigkill", "--fault", "0:1:13:kill")
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts == {(0, 0): 0, (1, 0): 0, (0, 1): 10, (1, 1): 10}
    assert_exact(events, reference)
    (kill,) = report(injected_recoveries(events))
    assert kill.redone == 3, "trained to 13, resumed from 10"
    state = coordinator.job("sigkill")
    assert state.failures >= 1 and state.restore_step == STEPS


def test_restarted_workers_start_in_warm_spares_and_end_bitwise_equal(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    """``checkflow run`` keeps one spare interpreter per local rank with torch, its
    ``_dynamo`` and checkflow imported; after the SIGKILL both new workers are those spares.
    The gate holds training at step 12 until both spares said they were ready."""
    gate = tmp_path / "spares-ready"
    job = start(tmp_path, coordinator, "warm", "--fault", "0:1:13:kill", "--gate", f"12:{gate}")
    ready = [f"warm spare for local rank {r} ready" for r in (0, 1)]
    wait_until(lambda: all(line in job.output.read_text() for line in ready), WAIT_S)
    gate.touch()
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts == {(0, 0): 0, (1, 0): 0, (0, 1): 10, (1, 1): 10}
    assert events.warm == {(0, 1), (1, 1)}, "round 1 started in the spares, round 0 cold"
    assert_exact(events, reference)
    (kill,) = report(injected_recoveries(events))
    assert kill.redone == 3
    # The spares had imported torch and checkflow: the job's own imports cost nothing.
    assert kill.parts["import"] < 1.0, kill.parts


def ended_by_the_coordinator(launcher_output: str, *, rank: int) -> bool:
    """Round 0 ended because the coordinator failed the generation: ``rank`` was told to
    abort by its heartbeat reply, or the agent saw a local rank declared failed."""
    told = f"rank {rank} aborting (exit code 75)" in launcher_output
    return told or "(declared failed): restarting the local workers" in launcher_output


def test_frozen_rank_is_declared_silent_the_other_aborts_and_the_launcher_sigkills_it(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    with_timeouts(coordinator, "freeze", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    job = start(tmp_path, coordinator, "freeze", "--fault", "0:1:13:stop")
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 10
    assert_exact(events, reference)
    report(injected_recoveries(events))
    assert failures(coordinator, "freeze")[0] == (1, FaultKind.SILENT)
    # A stopped process obeys SIGKILL only: round 1 started, so the launcher sent it. Who
    # ends round 0 first is a race of two one-second loops, both correct: rank 0's heartbeat
    # (told to abort: exit 75) or the agent's poll (a local rank declared failed).
    assert ended_by_the_coordinator(job.output.read_text(), rank=0)


def test_rank_stuck_in_python_while_the_other_waits_in_a_collective_is_found_hung(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    hang = ("--hang-timeout", str(HANG_TIMEOUT_S))
    job = start(tmp_path, coordinator, "hang", *hang, "--fault", "0:1:13:spin")
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 10
    assert_exact(events, reference)
    report(injected_recoveries(events))
    found = failures(coordinator, "hang")
    assert (1, FaultKind.HUNG) in found, found
    # Its heartbeat thread exits 75, unless the agent's poll sees it declared failed first.
    assert ended_by_the_coordinator(job.output.read_text(), rank=1)


def test_coordinator_sigkilled_mid_run_training_goes_on_and_it_comes_back_with_its_state(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    name = "coordinator-killed"
    down, back = tmp_path / "coordinator-down", tmp_path / "coordinator-back"
    gates = ("--gate", f"12:{down}", "--gate", f"27:{back}")
    # The ranks wait at a gate while the coordinator restarts and learns the commits: on a
    # loaded machine that takes longer than the 60 s hang timeout, and no hang is tested here.
    gates += ("--hang-timeout", "600")
    job = start(tmp_path, coordinator, name, *gates)
    job.wait_for(lambda e: {(0, 0, 12), (1, 0, 12)} <= e.gates, WAIT_S, "both ranks at 12")
    wait_until(lambda: coordinator.job(name).restore_step == 10, WAIT_S, "step 10 committed")
    before = coordinator.job(name)

    coordinator.kill()
    killed = time.time()
    down.touch()
    events = job.wait_for(lambda e: {(0, 0, 27), (1, 0, 27)} <= e.gates, WAIT_S, "step 27")
    storage = Storage(str(tmp_path / "ckpt"))
    # Persists run in the background: 25 may still be on its way.
    wait_until(lambda: {15, 20, 25} <= set(committed_steps(storage)), WAIT_S, "commits")
    report([recovery(events, "coordinator SIGKILLed", killed, 0)])

    # Its operator lets it list the job's (local) storage: how it learns the commits made
    # while it was down (by default it reads no storage, `--storage-allow`).
    coordinator.options += ("--storage-allow", "file")
    coordinator.start()  # on the same port and database
    after = coordinator.job(name)
    assert (after.name, after.generation, after.failures) == (name, before.generation, 0)
    assert {5, 10} <= committed(coordinator, name), "what it knew before the kill"
    # Learned by listing storage, in the background after the start.
    wait_until(lambda: {15, 20, 25} <= committed(coordinator, name), WAIT_S, "commits learned")
    back.touch()
    events = job.finish(RUN_TIMEOUT_S)

    assert events.rounds == [0], "no rank failed: the coordinator was down, not the job"
    assert_exact(events, reference)
    final = coordinator.job(name)
    assert (final.generation, final.failures, final.restore_step) == (before.generation, 0, STEPS)


def test_s3_down_for_30s_during_a_persist_never_shows_a_half_written_step_and_training_goes_on(
    tmp_path: Path,
    coordinator: ServerProcess,
    reference: str,
    s3_endpoint: str,
    s3_fault_proxy: FaultyS3Proxy,
    faulty_s3: S3Location,
) -> None:
    outage = s3_fault_proxy.outage(
        30, when=lambda method, path: method == "PUT" and "/step-000000015/" in path
    )
    direct = Storage(faulty_s3.uri, storage_options=s3_options(s3_endpoint))
    # Collectives wait longer than the outage: a rank waiting for a host buffer set (both
    # are stuck persisting) holds the other in the next collective, and a 30 s timeout
    # there would crash the job instead of letting it wait. That wait is a known pause:
    # the short hang timeout must not take it for a hang.
    patient = ("--pg-timeout", "120", "--hang-timeout", str(HANG_TIMEOUT_S))
    with CommitWatcher(direct) as watcher:
        job = start(
            tmp_path, coordinator, "s3-outage", *patient, storage=faulty_s3.uri, env=faulty_s3.env
        )
        events = job.finish(RUN_TIMEOUT_S)

    assert outage.started.is_set() and outage.end is not None
    assert events.rounds == [0], "S3 down is no reason to restart"
    assert_exact(events, reference)
    assert watcher.problems == [], "a reader saw a step committed but not whole"
    assert watcher.first_seen, "the watcher saw the commits"
    late = watcher.first_seen.get(15)
    when = "never" if late is None else f"{late - outage.start:.1f} s after S3 went down"
    print(f"step 15 committed: {when}")
    assert late is None or late >= outage.end - 1, "step 15 cannot commit while S3 is down"
    report([recovery(events, "S3 down for 30 s", outage.start, events.round_at(outage.start))])
    print(f"training held for at most {events.longest_pause(outage.start):.1f} s by the outage")
    assert STEPS in committed_steps(direct), "the last checkpoint commits once S3 is back"


# --- faults in the recovery itself, and in a row ------------------------------------------------
def test_rank_sigkilled_while_it_restores_after_a_first_fault_is_restarted_again(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    faults = ("--fault", "0:1:13:kill", "--fault", "1:1:0:restore-kill")
    job = start(tmp_path, coordinator, "restore-kill", *faults)
    events = job.finish(RUN_TIMEOUT_S)

    assert (1, 1) not in events.starts, "rank 1 died inside restore() in round 1"
    assert events.starts[(0, 2)] == events.starts[(1, 2)] == 10
    assert_exact(events, reference)
    first, second = report(injected_recoveries(events))
    assert first.restored == second.restored == 10
    assert first.faults == 2, "round 1 never trained: the second fault came during restore"


def test_three_faults_in_a_row_kill_freeze_kill_each_recovered(
    tmp_path: Path, coordinator: ServerProcess, reference: str
) -> None:
    with_timeouts(coordinator, "three", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    faults = ("--fault", "0:1:13:kill", "--fault", "1:0:18:stop", "--fault", "2:1:23:kill")
    job = start(tmp_path, coordinator, "three", *faults)
    events = job.finish(RUN_TIMEOUT_S)

    assert [events.starts[(0, k)] for k in range(4)] == [0, 10, 15, 20]
    assert_exact(events, reference)
    recoveries = report(injected_recoveries(events))
    assert [r.restored for r in recoveries] == [10, 15, 20]


class CommitWatcher:
    """A reader polling a checkpoint root: every step that shows a commit must verify
    whole (every rank's part, every chunk decoding) the first time it is seen."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.first_seen: dict[int, float] = {}
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CommitWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._look()  # once more: the last commit

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._look()
            except Exception as e:  # a reader failing is what this watcher looks for
                self.problems.append(f"reading the checkpoints failed: {e!r}")

    def _look(self) -> None:
        try:
            catalog = scan(self.storage)
        except FileNotFoundError:
            return  # nothing written yet
        self.problems += [f"step {s}: {why}" for s, why in catalog.damaged.items()]
        reader = CheckpointReader(self.storage)
        for step in catalog.committed:
            if step not in self.first_seen:
                self.first_seen[step] = time.time()
                self.problems += reader.verify(step)
