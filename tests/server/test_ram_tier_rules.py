"""The coordinator's knowledge of the RAM tier (issue 11), on plain objects: a step every
rank holds in node memory is a restore point, the newest of both tiers wins, nothing is
committed or written for it, and a roll-back forgets newer RAM steps."""

from __future__ import annotations

from checkflow_server.domain import checkpoints, jobs, ranks
from checkflow_server.domain.state import Job
from checkflow_server.domain.views import restore_point

from checkflow.protocol import (
    CheckpointStatus,
    CheckpointTier,
    CommitReport,
    JobCreate,
    PartReport,
    RecoverRequest,
    RegisterRequest,
)


def started_job(world: int = 2) -> Job:
    job, _ = jobs.create_job(JobCreate(name="j", world_size=world), 100.0, warmup_interval=10)
    for r in range(world):
        ranks.register(job, r, RegisterRequest(instance=f"p{r}"), 100.0)
    return job


def report(job: Job, step: int, rank: int, tier: CheckpointTier) -> bool:
    body = PartReport(
        generation=job.generation, nbytes=10, duration_s=0.1, manifest_path="m", tier=tier
    )
    reply, changes = checkpoints.report_part(job, step, rank, body, 102.0)
    if tier == CheckpointTier.RAM:
        assert not reply.must_commit and not changes.parts, "nothing to commit or write"
    return reply.must_commit


def stored(job: Job, step: int) -> None:
    movers = [r for r in range(job.world_size) if report(job, step, r, CheckpointTier.STORAGE)]
    checkpoints.commit(job, step, CommitReport(rank=movers[0]), 103.0)


def test_a_step_every_rank_holds_in_ram_is_the_restore_point_when_newer_than_storage() -> None:
    job = started_job()
    stored(job, 10)
    report(job, 13, 0, CheckpointTier.RAM)
    assert restore_point(job).step == 10, "one rank's RAM copy is not a restore point"
    report(job, 13, 1, CheckpointTier.RAM)
    assert (restore_point(job).step, job.ram_step(), job.stored_step()) == (13, 13, 10)
    assert 13 not in job.checkpoints, "a RAM step is no storage checkpoint"
    stored(job, 15)
    assert (restore_point(job).step, job.stored_step()) == (15, 15)


def test_a_failure_restarts_the_schedule_from_the_newest_ram_step() -> None:
    job = started_job()
    stored(job, 10)
    for r in (0, 1):
        report(job, 13, r, CheckpointTier.RAM)
    ranks.register(job, 1, RegisterRequest(instance="p1-restarted"), 104.0)  # a crash
    assert job.generation == 2
    assert job.restore_step() == 13 and job.max_step == 13


def test_a_rollback_forgets_ram_steps_newer_than_its_step() -> None:
    job = started_job()
    stored(job, 10)
    for r in (0, 1):
        report(job, 13, r, CheckpointTier.RAM)
    jobs.recover(job, RecoverRequest(step=10), 105.0)
    assert restore_point(job).step == 10 and job.ram == {}


def test_the_coordinator_remembers_only_the_newest_ram_steps() -> None:
    job = started_job(world=1)
    for step in range(1, 11):
        report(job, step, 0, CheckpointTier.RAM)
    assert sorted(job.ram) == [7, 8, 9, 10]
    assert (
        job.checkpoints.get(10) is None or job.checkpoints[10].status != CheckpointStatus.COMMITTED
    )
