"""Recovery from the RAM tier with real processes (issue 11).

Real parts only: ``checkflow run --ram-tier`` (torch's elastic agent) starting the 2 gloo
DDP ranks of ``_ddp_job.py`` (30 steps, a checkpoint every 5), the real coordinator
(``checkflow serve``), a RAM-tier folder under ``/dev/shm`` (tmpfs). Rank 1 SIGKILLs itself
after step 13, once step 10 committed; the agent restarts both ranks, which restore step 10
(the coordinator's restore point). Each ``restore()`` logs which tier it read and how many
reads it made from storage (``Storage.reads``: every read and listing of the storage root).
Each test ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkflow.catalog import committed_steps
from checkflow.memory.area import node_area, rank_root
from checkflow.storage import Storage
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.jobs import Events, LaunchedJob, injected_recoveries, launch
from tests.support.net import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 30
RUN_TIMEOUT_S = 420
"""A safety net, not a bound (see test_faults.py)."""
WAIT_S = 120


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Digest of the final parameters and optimizer state of the job run without a fault
    and without a RAM tier."""
    folder = tmp_path_factory.mktemp("reference")
    job = launch(folder, "--dir", str(folder / "ckpt"), "--steps", str(STEPS), "--kill-at", "99")
    events = job.finish(RUN_TIMEOUT_S)
    assert events.rounds == [0] and events.states[0] == events.states[1]
    return events.states[0]


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with served(tmp_path_factory.mktemp("coordinator") / "coordinator.db") as server:
        yield server


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A RAM-tier root of this test's own on the machine's tmpfs."""
    root = Path("/dev/shm") / f"checkflow-test-{uuid.uuid4().hex[:12]}"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start(
    folder: Path, coordinator: ServerProcess, job: str, shm: Path, *job_args: str
) -> LaunchedJob:
    launcher = ("--max-restarts=3", "--coordinator", coordinator.url, "--job", job)
    launcher += ("--token", TOKEN, "--ram-tier", "--ram-root", str(shm))
    args = ("--dir", str(folder / "ckpt"), "--steps", str(STEPS), "--kill-at", "99", *job_args)
    return launch(folder, *args, launcher_args=launcher)


def node_folder(shm: Path, job: str) -> Path:
    return Path(node_area(str(shm), job, os.uname().nodename))


def assert_exact(events: Events, reference: str) -> None:
    assert events.states == {0: reference, 1: reference}, (
        "parameters and optimizer state differ from the uninterrupted run"
    )


def test_crashed_rank_restores_from_the_ram_tier_without_reading_storage(
    tmp_path: Path, coordinator: ServerProcess, reference: str, shm_root: Path
) -> None:
    job = start(tmp_path, coordinator, "ram-crash", shm_root, "--fault", "0:1:13:kill")
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 10
    assert events.tiers[(0, 1)] == events.tiers[(1, 1)] == ("ram", 0), events.tiers
    assert_exact(events, reference)
    for r in injected_recoveries(events):
        print(r.line())
    assert not node_folder(shm_root, "ram-crash").exists(), "the agent frees the RAM tier"


def test_damaged_ram_copy_is_read_from_storage_with_a_warning(
    tmp_path: Path, coordinator: ServerProcess, reference: str, shm_root: Path
) -> None:
    gate = tmp_path / "damaged"
    job = start(
        tmp_path, coordinator, "ram-damage", shm_root, "--fault", "0:1:13:kill",
        "--gate", f"12:{gate}",
    )  # fmt: skip
    job.wait_for(lambda e: {(0, 0, 12), (1, 0, 12)} <= e.gates, WAIT_S, "both ranks at 12")
    ram = Storage(rank_root(str(node_folder(shm_root, "ram-damage")), 1))
    wait_until(lambda: 10 in committed_steps(ram), WAIT_S, "step 10 in rank 1's RAM tier")
    chunks = Path(ram.path("step-000000010/rank-00000-000.chunks"))
    data = bytearray(chunks.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the rank's objects: its checksum no longer matches
    chunks.write_bytes(bytes(data))
    gate.touch()
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 10
    assert events.tiers[(0, 1)] == ("ram", 0)
    assert events.tiers[(1, 1)][0] == "storage", events.tiers
    assert "the RAM copy of step 10" in job.output.read_text(), "no warning"
    assert_exact(events, reference)


def test_ram_tier_every_step_restarts_at_the_crashed_step_with_nothing_redone(
    tmp_path: Path, coordinator: ServerProcess, reference: str, shm_root: Path
) -> None:
    # Storage every 5 steps, the RAM tier every step: the coordinator's restore point is the
    # newest step every rank holds in some tier, 13, not storage's 10.
    job = start(
        tmp_path, coordinator, "ram-every", shm_root, "--fault", "0:1:13:kill", "--ram-every", "1"
    )
    events = job.finish(RUN_TIMEOUT_S)

    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 13
    assert events.tiers[(0, 1)] == events.tiers[(1, 1)] == ("ram", 0), events.tiers
    (kill,) = injected_recoveries(events)
    print(kill.line())
    assert kill.redone == 0
    assert_exact(events, reference)
    assert max(committed_steps(Storage(str(tmp_path / "ckpt")))) == STEPS
