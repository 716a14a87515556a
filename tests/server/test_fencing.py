"""Fenced state changes against a real ``checkflow serve``: a commit, a part or a heartbeat
of an ended generation is refused (409) and changes nothing, so a replayed or late report
never undoes a roll-back; and a roll-back (``checkflow restore --coordinator``) raises the
generation."""

from __future__ import annotations

import httpx
import pytest

from checkflow.cli import main
from checkflow.protocol import paths
from tests.support.coordinator import TOKEN, ServerProcess

JOB = "fenced"


def post(c: httpx.Client, template: str, body: dict, **where: str | int) -> httpx.Response:
    return c.post(paths.path(template, job=JOB, **where), json=body)


def checkpoint(c: httpx.Client, step: int, generation: int, *, commit: bool = True) -> None:
    """Both ranks report their part of ``step``; the committer commits it (``commit``)."""
    part = {"generation": generation, "nbytes": 1, "duration_s": 0.1, "manifest_path": "m"}
    for rank in (0, 1):
        r = c.put(paths.path(paths.PART, job=JOB, step=step, rank=rank), json=part)
        assert r.status_code == 200, r.text
    if commit:
        r = post(c, paths.COMMIT, {"rank": 1, "generation": generation}, step=step)
        assert r.status_code == 200 and r.json()["status"] == "committed", r.text


def restore_point(c: httpx.Client) -> tuple[int, int | None]:
    reply = c.get(paths.path(paths.RESTORE_POINT, job=JOB)).json()
    return reply["generation"], reply["step"]


def statuses(c: httpx.Client) -> dict[int, str]:
    listed = c.get(paths.path(paths.CHECKPOINTS, job=JOB)).json()["checkpoints"]
    return {ck["step"]: ck["status"] for ck in listed}


@pytest.fixture
def job(server: ServerProcess) -> httpx.Client:
    """A job of two registered ranks in generation 1 with step 10 and 20 committed."""
    c = server.http()
    r = c.post(paths.path(paths.JOBS), json={"name": JOB, "world_size": 2})
    assert r.status_code in (200, 201), r.text
    for rank in (0, 1):
        assert post(c, paths.REGISTER, {"instance": f"i{rank}"}, rank=rank).status_code == 200
    checkpoint(c, 10, 1)
    checkpoint(c, 20, 1)
    assert restore_point(c) == (1, 20)
    return c


def roll_back_with_the_cli(server: ServerProcess, step: int, capsys) -> None:
    args = ["restore", "--coordinator", server.url, "--job", JOB, "--step", str(step)]
    assert main([*args, "--token", TOKEN]) == 0
    assert f"rolled back to step {step}: generation 2" in capsys.readouterr().out


def test_a_replayed_commit_after_a_roll_back_does_not_move_the_restore_point(
    server: ServerProcess, job: httpx.Client, capsys
) -> None:
    roll_back_with_the_cli(server, 10, capsys)
    assert restore_point(job) == (2, 10)
    # The commit of step 20 replayed as it was sent, and as an older client sends it.
    for body in ({"rank": 1, "generation": 1}, {"rank": 1}):
        r = post(job, paths.COMMIT, body, step=20)
        assert r.status_code == 409, r.text
        assert "generation" in r.json()["detail"]
    assert restore_point(job) == (2, 10)
    assert statuses(job) == {20: "abandoned", 10: "committed"}


def test_a_commit_in_flight_during_the_roll_back_does_not_move_the_restore_point(
    server: ServerProcess, job: httpx.Client, capsys
) -> None:
    checkpoint(job, 30, 1, commit=False)  # every part reported; its commit is on the way
    roll_back_with_the_cli(server, 10, capsys)
    r = post(job, paths.COMMIT, {"rank": 1, "generation": 1}, step=30)
    assert r.status_code == 409 and "generation 1" in r.json()["detail"], r.text
    late = {"generation": 1, "nbytes": 1, "duration_s": 0.1, "manifest_path": "m"}
    r = job.put(paths.path(paths.PART, job=JOB, step=40, rank=0), json=late)
    assert r.status_code == 409, r.text
    assert restore_point(job) == (2, 10)
    assert statuses(job) == {30: "abandoned", 20: "abandoned", 10: "committed"}


def test_a_heartbeat_of_an_ended_generation_is_refused_and_records_nothing(
    server: ServerProcess, job: httpx.Client, capsys
) -> None:
    assert (
        post(job, paths.RANK_HEARTBEAT, {"generation": 1, "step": 25}, rank=0).json()["action"]
        == "continue"
    )
    roll_back_with_the_cli(server, 10, capsys)
    r = post(job, paths.RANK_HEARTBEAT, {"generation": 1, "step": 99}, rank=0)
    assert r.status_code == 409, r.text
    assert "generation 1 ended: the job moved to generation 2" in r.json()["detail"]
    [rank0, _] = job.get(paths.path(paths.RANKS, job=JOB)).json()["ranks"]
    assert (rank0["step"], rank0["state"], rank0["alive"]) == (25, "aborted", False)
    # The restarted rank registers in generation 2 and its heartbeats count again.
    reg = post(job, paths.REGISTER, {"instance": "new0"}, rank=0).json()
    assert (reg["generation"], reg["restore_step"]) == (2, 10)
    ok = post(job, paths.RANK_HEARTBEAT, {"generation": 2, "step": 11}, rank=0)
    assert ok.status_code == 200 and ok.json()["action"] == "continue", ok.text


def test_a_commit_of_a_generation_never_issued_is_refused(job: httpx.Client) -> None:
    checkpoint(job, 30, 1, commit=False)
    r = post(job, paths.COMMIT, {"rank": 1, "generation": 7}, step=30)
    assert r.status_code == 409 and "generation 7" in r.json()["detail"], r.text
    assert statuses(job)[30] == "in_progress"
    # An older client's commit (no generation) of the current generation still works.
    r = post(job, paths.COMMIT, {"rank": 1}, step=30)
    assert r.status_code == 200 and r.json()["status"] == "committed", r.text
    assert restore_point(job) == (1, 30)


def test_a_failure_raises_the_generation_and_fences_the_old_one_too(job: httpx.Client) -> None:
    checkpoint(job, 30, 1, commit=False)
    body = {"generation": 1, "exit_code": -9, "seconds_ago": 0.1}
    assert post(job, paths.FAILURE, body, rank=0).json()["state"] == "failed"
    assert restore_point(job) == (2, 20)
    r = post(job, paths.COMMIT, {"rank": 1, "generation": 1}, step=30)
    assert r.status_code == 409, r.text
    assert restore_point(job) == (2, 20)
