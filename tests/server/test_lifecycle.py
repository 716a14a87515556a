"""A job's life (running, recovering, finished, stopped, failed): the pure transitions of
``domain.lifecycle``, and the rules that apply them, on plain objects (no database, no
HTTP, no clock); then that the state and a pending roll-back survive a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkflow_server.domain import checkpoints, jobs, lifecycle, ranks
from checkflow_server.domain.errors import Conflict
from checkflow_server.domain.state import Job
from checkflow_server.repository import Repository

from checkflow.protocol import (
    CheckpointStatus,
    CommitReport,
    FailureReport,
    FinishRequest,
    JobCreate,
    JobState,
    PartReport,
    RankState,
    RecoverRequest,
    RegisterRequest,
    StopReason,
    StopRequest,
)

RUNNING, RECOVERING = JobState.RUNNING, JobState.RECOVERING
FINISHED, STOPPED, FAILED = JobState.FINISHED, JobState.STOPPED, JobState.FAILED
INTERRUPTED, GAVE_UP = StopReason.INTERRUPTED, StopReason.GAVE_UP


# --- the transitions --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "expected"),
    [(RUNNING, RECOVERING), (RECOVERING, RECOVERING)] + [(s, s) for s in lifecycle.ENDED],
)
def test_a_new_generation_makes_a_live_job_recover_and_leaves_an_ended_one_ended(
    state: JobState, expected: JobState
) -> None:
    assert lifecycle.on_new_generation(state) == expected


def test_a_registration_runs_the_job_or_keeps_it_recovering() -> None:
    assert lifecycle.on_registered(recovering=False) == RUNNING
    assert lifecycle.on_registered(recovering=True) == RECOVERING


def test_the_job_is_finished_when_the_last_rank_finishes_and_an_ended_job_stays() -> None:
    assert lifecycle.on_finished(RUNNING, 1, 2) == RUNNING
    assert lifecycle.on_finished(RUNNING, 2, 2) == FINISHED
    assert lifecycle.on_finished(STOPPED, 2, 2) == STOPPED


@pytest.mark.parametrize(
    ("state", "reason", "expected"),
    [
        (RUNNING, INTERRUPTED, STOPPED),
        (RECOVERING, INTERRUPTED, STOPPED),
        (RECOVERING, GAVE_UP, FAILED),
        (FINISHED, INTERRUPTED, FINISHED),
        (FAILED, INTERRUPTED, FAILED),
    ],
)
def test_a_stop_is_stopped_or_failed_and_never_undoes_an_end(
    state: JobState, reason: StopReason, expected: JobState
) -> None:
    assert lifecycle.on_stopped(state, reason) == expected


def test_a_row_of_an_older_coordinator_has_the_state_its_columns_imply() -> None:
    assert lifecycle.from_stored(None, recovering=True) == RECOVERING
    assert lifecycle.from_stored(None, recovering=False) == RUNNING
    assert lifecycle.from_stored("finished", recovering=False) == FINISHED


# --- the rules that apply them ----------------------------------------------------------
def started_job(world: int = 2, now: float = 100.0) -> Job:
    job, _ = jobs.create_job(JobCreate(name="j", world_size=world), now, warmup_interval=10)
    for r in range(world):
        ranks.register(job, r, RegisterRequest(instance=f"p{r}"), now)
    return job


def committed(job: Job, step: int) -> None:
    for r in range(job.world_size):
        body = PartReport(generation=job.generation, nbytes=1, duration_s=0.1, manifest_path="m")
        checkpoints.report_part(job, step, r, body, 101.0)
    checkpoints.commit(job, step, CommitReport(rank=0, generation=job.generation), 101.0)


def finish_all(job: Job, step: int) -> list[str]:
    kinds = []
    for r in range(job.world_size):
        body = FinishRequest(generation=job.generation, step=step)
        kinds += [e.kind for e in ranks.finish(job, r, body, 110.0)[1].events]
    return kinds


def statuses(job: Job) -> dict[int, str]:
    return {s: str(c.status) for s, c in sorted(job.checkpoints.items())}


def test_a_job_whose_ranks_all_finish_is_finished_once_with_one_event() -> None:
    job = started_job()
    assert job.state == RUNNING
    assert finish_all(job, 30) == ["job_finished"]
    assert job.state == FINISHED and job.alive_ranks() == 0
    assert ranks.detect(job, 10_000.0).events == []  # silence after the end is no failure


def test_a_failure_recovers_and_every_rank_back_runs_again() -> None:
    job = started_job()
    ranks.report_failure(job, 1, FailureReport(generation=1, exit_code=1), 105.0)
    assert job.state == RECOVERING
    ranks.register(job, 0, RegisterRequest(instance="q0"), 106.0)
    assert job.state == RECOVERING
    ranks.register(job, 1, RegisterRequest(instance="q1"), 106.0)
    assert job.state == RUNNING


def test_a_stop_ends_the_job_and_unwatches_its_ranks() -> None:
    job = started_job()
    reply, changes = jobs.stop(job, StopRequest(generation=1, reason=INTERRUPTED), 105.0)
    assert reply.state == STOPPED and not reply.recovering and changes.job
    assert [e.kind for e in changes.events] == ["job_stopped"]
    assert job.ranks.state == [RankState.ABORTED] * 2 and sorted(changes.ranks) == [0, 1]
    assert ranks.detect(job, 10_000.0).events == []  # no failure, no new generation
    assert job.generation == 1
    again = jobs.stop(job, StopRequest(generation=1, reason=GAVE_UP), 106.0)[1]
    assert not again.writes() and job.state == STOPPED  # a second stop changes nothing
    ranks.register(job, 0, RegisterRequest(instance="r0"), 200.0)  # launched again
    assert job.state == RUNNING


def test_a_launcher_that_gave_up_after_its_crash_report_fails_the_job() -> None:
    job = started_job()
    ranks.report_failure(job, 0, FailureReport(generation=1, exit_code=1), 105.0)
    assert (job.generation, job.state) == (2, RECOVERING)
    # Its view was of generation 1; nobody registered in generation 2: taken.
    jobs.stop(job, StopRequest(generation=1, reason=GAVE_UP), 106.0)
    assert job.state == FAILED


def test_a_stale_stop_never_stops_a_job_another_launcher_runs() -> None:
    job = started_job()
    ranks.report_failure(job, 0, FailureReport(generation=1, exit_code=1), 105.0)
    ranks.register(job, 0, RegisterRequest(instance="q0"), 106.0)
    with pytest.raises(Conflict, match="ranks alive in generation 2"):
        jobs.stop(job, StopRequest(generation=1, reason=INTERRUPTED), 107.0)
    with pytest.raises(Conflict, match="generation 3 is not"):
        jobs.stop(job, StopRequest(generation=3, reason=INTERRUPTED), 107.0)
    assert job.state == RECOVERING


def test_a_roll_back_of_a_finished_job_keeps_its_commits_until_it_is_launched_again() -> None:
    job = started_job()
    for step in (10, 20, 30):
        committed(job, step)
    finish_all(job, 30)
    reply, changes = jobs.recover(job, RecoverRequest(step=10), 120.0)
    assert (reply.generation, reply.step) == (2, 10)
    assert statuses(job) == {10: "committed", 20: "committed", 30: "committed"}
    assert list(changes.checkpoints) == [] and job.state == FINISHED
    assert job.restore_step() == 10 and job.next_checkpoint_step() == 20
    # Launched again: its ranks restore step 10 and write steps 20 and 30 anew.
    registration, changes = ranks.register(job, 0, RegisterRequest(instance="n0"), 130.0)
    assert registration.restore_step == 10 and job.rollback_step is None
    assert statuses(job) == {10: "committed", 20: "abandoned", 30: "abandoned"}
    assert sorted(changes.checkpoints) == [20, 30] and job.state == RECOVERING


def test_a_roll_back_of_a_running_job_abandons_the_newer_commits_at_once() -> None:
    job = started_job()
    for step in (10, 20):
        committed(job, step)
    jobs.recover(job, RecoverRequest(step=10), 120.0)
    assert statuses(job) == {10: "committed", 20: "abandoned"}
    assert job.state == RECOVERING and job.rollback_step is None


def test_the_state_and_a_pending_roll_back_survive_a_restart(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "c.db")
    job, changes = jobs.create_job(JobCreate(name="j", world_size=1), 1.0, warmup_interval=10)
    repo.save(job, changes)
    repo.save(job, ranks.register(job, 0, RegisterRequest(), 2.0)[1])
    part = PartReport(generation=1, nbytes=1, duration_s=0.1, manifest_path="m")
    for step in (10, 20):
        repo.save(job, checkpoints.report_part(job, step, 0, part, 2.0)[1])
        repo.save(job, checkpoints.commit(job, step, CommitReport(rank=0, generation=1), 2.0)[1])
    repo.save(job, ranks.finish(job, 0, FinishRequest(generation=1, step=20), 3.0)[1])
    repo.save(job, jobs.recover(job, RecoverRequest(step=10), 4.0)[1])
    repo.close()
    (loaded,) = Repository(tmp_path / "c.db").load_jobs()
    assert (loaded.state, loaded.rollback_step, loaded.restore_step()) == (FINISHED, 10, 10)
    assert statuses(loaded) == {10: "committed", 20: "committed"}
    assert CheckpointStatus.ABANDONED not in {c.status for c in loaded.checkpoints.values()}


# --- through the API ----------------------------------------------------------------------
def test_the_api_shows_the_state_takes_a_stop_and_filters_events_by_kind(client) -> None:
    client.post("/v1/jobs", json={"name": "j", "world_size": 1})
    client.post("/v1/jobs/j/ranks/0/register", json={})
    assert client.get("/v1/jobs/j").json()["state"] == "running"
    for body in ({"generation": 1, "reason": "bored"}, {"generation": 1}, {"reason": "gave_up"}):
        r = client.post("/v1/jobs/j/stop", json=body)
        assert r.status_code == 422, r.text
    assert (
        client.post("/v1/jobs/nope/stop", json={"generation": 1, "reason": "gave_up"}).status_code
        == 404
    )
    r = client.post("/v1/jobs/j/stop", json={"generation": 2, "reason": "gave_up"})
    assert r.status_code == 409 and "generation 2" in r.json()["detail"]
    r = client.post("/v1/jobs/j/stop", json={"generation": 1, "reason": "gave_up", "detail": "x"})
    assert r.status_code == 200 and r.json()["state"] == "failed"
    assert client.get("/v1/jobs/j").json()["state"] == "failed"
    newest = client.get("/v1/jobs/j/events", params={"limit": 1}).json()["events"]
    assert [e["kind"] for e in newest] == ["job_stopped"]
    created = client.get("/v1/jobs/j/events", params={"kind": ["job_created", "job_stopped"]})
    assert [e["kind"] for e in created.json()["events"]] == ["job_created", "job_stopped"]
    for bad in ("nothing", ""):  # only named kinds: anything else is refused, not ignored
        r = client.get("/v1/jobs/j/events", params={"kind": bad})
        assert r.status_code == 422, r.text
