"""Just-in-time checkpoints after a crash, with real processes (issue 11).

Real parts only: ``checkflow run --ram-tier`` (torch's elastic agent) starting the 2 gloo
DDP ranks of ``_ddp_job.py`` with ``Checkpointer(jit=True)`` (30 steps, a checkpoint every
5), the real coordinator (``checkflow serve``), a RAM-tier folder under ``/dev/shm``. Rank 1
SIGKILLs itself after step 13, between two checkpoints (step 10 committed). The survivor,
rank 0, is told to abort (or its collective with the dead rank fails) and writes step 13 to
the RAM tier before it exits; the coordinator counts that copy for both ranks, so the
restart resumes at 13: rank 0 from its own copy, rank 1 from rank 0's (a replica).
The fixtures are those of ``test_ram_recovery.py``, imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from checkflow.catalog import committed_steps
from checkflow.storage import Storage
from tests.launch import test_ram_recovery as ram
from tests.launch.test_ram_recovery import RUN_TIMEOUT_S, STEPS, assert_exact, start
from tests.support.coordinator import ServerProcess
from tests.support.jobs import Events, injected_recoveries

# test_ram_recovery's fixtures, by name: the uninterrupted run, the coordinator, the tmpfs root.
reference, coordinator, shm_root = ram.reference, ram.coordinator, ram.shm_root

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_jit_checkpoint_after_a_crash_between_checkpoints_leaves_at_most_one_step_to_redo(
    tmp_path: Path, coordinator: ServerProcess, reference: str, shm_root: Path
) -> None:
    job = start(tmp_path, coordinator, "jit-crash", shm_root, "--fault", "0:1:13:kill", "--jit")
    events = job.finish(RUN_TIMEOUT_S)

    (kill,) = injected_recoveries(events)
    print(kill.line())
    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 13, events.starts
    assert kill.redone <= 1
    # Both restored from the RAM tier, neither read storage: rank 1 read rank 0's copy.
    assert events.tiers[(0, 1)] == events.tiers[(1, 1)] == ("ram", 0), events.tiers
    output = job.output.read_text()
    assert "just-in-time checkpoint of step 13 written" in output
    assert "restores step 13 from" in output and "a replica's copy" in output
    assert_exact(events, reference)
    assert max(committed_steps(Storage(str(tmp_path / "ckpt")))) == STEPS


def test_survivor_told_to_abort_by_the_coordinator_writes_its_jit_copy_first(
    tmp_path: Path, coordinator: ServerProcess, reference: str, shm_root: Path
) -> None:
    # Rank 0 waits at a gate after step 13, in no collective: only its heartbeat's abort
    # tells it of rank 1's crash, and the heartbeat thread writes the copy.
    gate = tmp_path / "never"
    job = start(
        tmp_path, coordinator, "jit-abort", shm_root, "--fault", "0:1:13:kill", "--jit",
        "--gate", f"13:{gate}",
    )  # fmt: skip
    events = job.finish(RUN_TIMEOUT_S)

    assert (0, 0, 13) in events.gates
    assert events.starts[(0, 1)] == events.starts[(1, 1)] == 13, events.starts
    (kill,) = injected_recoveries(events)
    print(kill.line())
    assert kill.redone <= 1
    jit_lines = [line for line in job.output.read_text().splitlines() if "just-in-time" in line]
    assert any("step 13 written" in line and "moved to generation" in line for line in jit_lines)
    assert_exact(events, reference)


def test_survivor_of_a_frozen_rank_writes_its_jit_copy_before_the_restart(
    tmp_path: Path, coordinator: ServerProcess, reference: str, shm_root: Path
) -> None:
    # Rank 1 SIGSTOPs itself after step 13; rank 0 waits for it in the next all-reduce (no
    # error: the peer's socket stays open). The coordinator declares rank 1 silent after its
    # heartbeat timeout; rank 0, told to abort, writes step 13 first (when the agent sees
    # rank 1 declared failed first, it SIGKILLs rank 1 only and gives rank 0 the JIT grace).
    job = start(tmp_path, coordinator, "jit-freeze", shm_root, "--fault", "0:1:13:stop", "--jit")
    events = job.finish(RUN_TIMEOUT_S)

    # Who ends round 0 first is a race (see test_faults' freeze test): rank 0's abort, then
    # a restart of the local workers that torch may not count as a new round, or the agent.
    assert last_starts(events) == {0: 13, 1: 13}, events.starts
    assert "just-in-time checkpoint of step 13 written" in job.output.read_text()
    assert_exact(events, reference)


def last_starts(events: Events) -> dict[int, int]:
    """Each rank's step restored in its last start (rounds may repeat: see above)."""
    rounds = {rank: max(k for r, k in events.starts if r == rank) for rank in (0, 1)}
    return {rank: events.starts[(rank, k)] for rank, k in rounds.items()}
