"""``/metrics``'s per-job gauges on plain objects (``metrics.job_gauges``, ``render``): a
finished job told from a dead one, the newest committed checkpoint only, and the label
``checkflow_job``. ``tests/deploy/test_prometheus.py`` reads them through Prometheus."""

from __future__ import annotations

from checkflow_server.domain import checkpoints, jobs, ranks
from checkflow_server.domain.state import Job
from checkflow_server.metrics import JobGauges, Metrics, job_gauges

from checkflow.protocol import (
    CommitReport,
    FailureReport,
    FinishRequest,
    Heartbeat,
    JobCreate,
    PartReport,
    RecoverRequest,
    RegisterRequest,
)


def started_job(name: str = "j", world: int = 2, now: float = 100.0) -> Job:
    job, _ = jobs.create_job(JobCreate(name=name, world_size=world), now, warmup_interval=10)
    for r in range(world):
        ranks.register(job, r, RegisterRequest(instance=f"p{r}"), now)
    return job


def commit(job: Job, step: int, now: float) -> None:
    for r in range(job.world_size):
        body = PartReport(generation=job.generation, nbytes=1, duration_s=0.1, manifest_path="m")
        reply, _ = checkpoints.report_part(job, step, r, body, now)
        if reply.must_commit:
            checkpoints.commit(job, step, CommitReport(rank=r), now)


def test_a_finished_job_has_every_rank_finished_and_a_crashed_one_none() -> None:
    done, crashed = started_job("done"), started_job("crashed")
    for r in range(2):
        ranks.rank_heartbeat(done, r, Heartbeat(generation=1, step=30), 101.0)
        ranks.finish(done, r, FinishRequest(generation=1, step=30), 102.0)
    ranks.rank_heartbeat(crashed, 0, Heartbeat(generation=1, step=7), 101.0)
    ranks.report_failure(crashed, 1, FailureReport(generation=1, exit_code=1), 102.0)
    assert (job_gauges(done).ranks_alive, job_gauges(done).ranks_finished) == (0, 2)
    assert (job_gauges(crashed).ranks_alive, job_gauges(crashed).ranks_finished) == (0, 0)
    assert job_gauges(crashed).step == 0  # the new generation trains on from its restore step


def test_a_finish_of_an_earlier_generation_is_not_counted_after_a_roll_back() -> None:
    job = started_job()
    commit(job, 10, 101.0)
    ranks.finish(job, 0, FinishRequest(generation=1, step=12), 102.0)
    jobs.recover(job, RecoverRequest(step=10), 103.0)
    assert job_gauges(job).ranks_finished == 0


def test_the_newest_committed_checkpoint_is_shown_not_one_in_progress() -> None:
    job = started_job()
    assert (job_gauges(job).checkpoint_step, job_gauges(job).checkpoint_at) == (None, None)
    commit(job, 10, 150.5)
    commit(job, 20, 160.25)
    body = PartReport(generation=1, nbytes=1, duration_s=0.1, manifest_path="m")
    checkpoints.report_part(job, 30, 0, body, 170.0)  # rank 1 has not persisted step 30
    g = job_gauges(job)
    assert (g.checkpoint_step, g.checkpoint_at, g.interval, g.world_size) == (20, 160.25, 10, 2)


def test_render_labels_every_job_series_checkflow_job_and_omits_absent_checkpoints() -> None:
    gauges = [
        JobGauges(name='a"b', world_size=2, ranks_alive=1, ranks_finished=1, step=40,
                  interval=10, checkpoint_step=30, checkpoint_at=1796000000.125),
        JobGauges(name="new", world_size=4, ranks_alive=0, ranks_finished=0, step=0,
                  interval=10, checkpoint_step=None, checkpoint_at=None),
    ]  # fmt: skip
    lines = Metrics().render(gauges).splitlines()
    assert "checkflow_jobs 2" in lines
    job_lines = [line for line in lines if "{checkflow_job=" in line]
    assert job_lines == [
        'checkflow_world_size{checkflow_job="a\\"b"} 2',
        'checkflow_world_size{checkflow_job="new"} 4',
        'checkflow_ranks_alive{checkflow_job="a\\"b"} 1',
        'checkflow_ranks_alive{checkflow_job="new"} 0',
        'checkflow_ranks_finished{checkflow_job="a\\"b"} 1',
        'checkflow_ranks_finished{checkflow_job="new"} 0',
        'checkflow_job_step{checkflow_job="a\\"b"} 40',
        'checkflow_job_step{checkflow_job="new"} 0',
        'checkflow_checkpoint_interval_steps{checkflow_job="a\\"b"} 10',
        'checkflow_checkpoint_interval_steps{checkflow_job="new"} 10',
        'checkflow_latest_checkpoint_step{checkflow_job="a\\"b"} 30',
        'checkflow_latest_checkpoint_timestamp_seconds{checkflow_job="a\\"b"} 1796000000.125',
        'checkflow_retention_failures_total{checkflow_job="a\\"b"} 0',
        'checkflow_retention_failures_total{checkflow_job="new"} 0',
        'checkflow_retention_failing{checkflow_job="a\\"b"} 0',
        'checkflow_retention_failing{checkflow_job="new"} 0',
    ]
    assert not [line for line in lines if "{job=" in line]
