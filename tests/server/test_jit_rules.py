"""The coordinator's rule for just-in-time copies (issue 11), on plain objects: a RAM part
reported with ``jit`` stands for every rank's part of its step, also when it comes from the
generation a failure just ended (the survivors write it as they exit), but never from one a
roll-back ended; a RAM part without ``jit`` counts for its own rank only."""

from __future__ import annotations

import pytest
from checkflow_server.domain import checkpoints, jobs, ranks
from checkflow_server.domain.errors import Conflict
from checkflow_server.domain.state import Job
from checkflow_server.domain.views import restore_point

from checkflow.protocol import CheckpointTier, PartReport, RecoverRequest, RegisterRequest
from tests.server.test_ram_tier_rules import started_job, stored


def ram_part(job: Job, step: int, rank: int, generation: int, *, jit: bool) -> None:
    body = PartReport(
        generation=generation,
        nbytes=10,
        duration_s=0.1,
        manifest_path="m",
        tier=CheckpointTier.RAM,
        jit=jit or None,
    )
    reply, changes = checkpoints.report_part(job, step, rank, body, 106.0)
    assert not reply.must_commit and not changes.parts, "nothing to commit or write"


def crashed(job: Job, rank: int) -> int:
    """Rank ``rank`` registers again (its process was replaced): the job moves on after a
    failure. Returns the generation that ended."""
    ended = job.generation
    instance = f"p{rank}-generation-{ended}"
    ranks.register(job, rank, RegisterRequest(instance=instance), 104.0)
    assert job.generation == ended + 1 and job.recovery is not None and job.recovery.kind
    return ended


def test_a_survivors_jit_copy_from_the_failed_generation_is_the_restore_point() -> None:
    job = started_job()
    stored(job, 10)
    ended = crashed(job, 1)
    assert restore_point(job).step == 10
    ram_part(job, 13, 0, ended, jit=True)
    assert (restore_point(job).step, job.ram_step(), job.stored_step()) == (13, 13, 10)


def test_a_ram_part_without_jit_stands_for_its_own_rank_only() -> None:
    job = started_job()
    stored(job, 10)
    ram_part(job, 13, 0, job.generation, jit=False)
    assert restore_point(job).step == 10
    ram_part(job, 14, 0, job.generation, jit=True)
    assert restore_point(job).step == 14


def test_a_jit_copy_from_a_generation_a_rollback_ended_is_refused() -> None:
    job = started_job()
    stored(job, 10)
    stored(job, 20)
    ended = job.generation
    jobs.recover(job, RecoverRequest(step=10), 105.0)
    with pytest.raises(Conflict):
        ram_part(job, 23, 0, ended, jit=True)
    assert restore_point(job).step == 10, "the roll-back's step stays the restore point"


def test_a_jit_copy_from_two_generations_ago_is_refused() -> None:
    job = started_job()
    stored(job, 10)
    first = crashed(job, 1)
    ranks.register(job, 0, RegisterRequest(instance="p0-restarted"), 104.5)  # recovered
    crashed(job, 1)
    with pytest.raises(Conflict):
        ram_part(job, 13, 0, first, jit=True)
    assert restore_point(job).step == 10
