"""A real ``checkflow serve`` subprocess driven by real client processes (simulated ranks
running :class:`checkflow.client.CoordinatorClient`)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from checkflow.client import ABORT_EXIT_CODE
from tests.support.coordinator import ServerProcess, start_rank

pytestmark = pytest.mark.slow


def finish(procs: list[subprocess.Popen[str]], timeout: float = 60) -> list[list[dict]]:
    """Wait for every rank; their JSON event lines."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
        p.stderr_text = stderr  # type: ignore[attr-defined]
    return out


def committed(server: ServerProcess, job: str) -> list[int]:
    with server.http() as http:
        r = http.get(f"/v1/jobs/{job}/checkpoints")
    if r.status_code == 404:  # no rank has created the job yet
        return []
    cks = r.json()["checkpoints"]
    return sorted(c["step"] for c in cks if c["status"] == "committed")


def test_ranks_agree_on_checkpoints_and_one_commits_each(server: ServerProcess) -> None:
    ranks = [
        start_rank(server.url, "agree", r, 3, "--steps", "40", "--step-time", "0.03")
        for r in range(3)
    ]
    outputs = finish(ranks)
    assert [p.returncode for p in ranks] == [0, 0, 0]
    steps = [[e["step"] for e in out if e["event"] == "checkpoint"] for out in outputs]
    assert steps == [[10, 20, 30, 40]] * 3
    for step in (10, 20, 30, 40):
        commits = [
            e
            for out in outputs
            for e in out
            if e["event"] == "checkpoint" and e["step"] == step and e["must_commit"]
        ]
        assert len(commits) == 1
    assert committed(server, "agree") == [10, 20, 30, 40]


def test_crashed_rank_aborts_the_others_and_the_restarted_group_restores(
    server: ServerProcess,
) -> None:
    # Rank 1 dies at step 25 (~1 s); the others would run to step 200 (~8 s), long past
    # the 3 s timeout even when a loaded machine delays the detection.
    args = ["--steps", "200", "--step-time", "0.04", "--heartbeat-timeout", "3"]
    ranks = [
        start_rank(server.url, "crash", r, 3, *args, *(["--crash-at", "25"] if r == 1 else []))
        for r in range(3)
    ]
    finish(ranks)
    assert [p.returncode for p in ranks] == [ABORT_EXIT_CODE, 1, ABORT_EXIT_CODE]
    assert "aborting (exit code 75)" in ranks[0].stderr_text  # type: ignore[attr-defined]
    with server.http() as http:
        events = http.get("/v1/jobs/crash/events").json()["events"]
    failed = [e for e in events if e["kind"] == "rank_failed"]
    assert [e["rank"] for e in failed] == [1]
    assert failed[0]["detail"]["silent_s"] <= 3 + 1.0
    assert committed(server, "crash") == [10, 20]

    # What torchrun does next: restart the whole group, which restores step 20.
    ranks = [start_rank(server.url, "crash", r, 3, *args) for r in range(3)]
    outputs = finish(ranks)
    assert [p.returncode for p in ranks] == [0, 0, 0]
    assert [out[0]["start"] for out in outputs] == [20, 20, 20]
    assert {out[0]["generation"] for out in outputs} == {2}
    # Every rank checkpoints the same steps (the simulated ranks' fixed every=10), and each
    # of them commits.
    steps = [[e["step"] for e in out if e["event"] == "checkpoint"] for out in outputs]
    assert steps[0] == steps[1] == steps[2]
    assert committed(server, "crash") == [10, 20, *steps[0]]
    with server.http() as http:
        kinds = [e["kind"] for e in http.get("/v1/jobs/crash/events").json()["events"]]
        metrics = http.get("/metrics").text
    assert "recovered" in kinds and "interval_changed" not in kinds  # a fixed every
    assert "checkflow_recovery_duration_seconds_count 1" in metrics.splitlines()


def test_sigkilled_coordinator_restarts_with_everything_and_ranks_carry_on(
    server: ServerProcess,
) -> None:
    # 300 steps of 50 ms: ~15 s, more than a kill and restart take on a loaded machine.
    args = ["--steps", "300", "--step-time", "0.05", "--heartbeat-timeout", "8"]
    ranks = [start_rank(server.url, "kill", r, 2, *args) for r in range(2)]
    deadline = time.monotonic() + 30
    while len(before := committed(server, "kill")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(before) >= 2
    with server.http() as http:
        events_before = http.get("/v1/jobs/kill/events").json()["events"]
    server.kill()
    time.sleep(1.0)
    server.start()
    with server.http() as http:
        job = http.get("/v1/jobs/kill").json()
        events_after = http.get("/v1/jobs/kill/events").json()["events"]
        assert events_after[: len(events_before)] == events_before
    assert set(before) <= set(committed(server, "kill"))
    assert job["generation"] == 1
    outputs = finish(ranks)
    assert [p.returncode for p in ranks] == [0, 0]  # no abort: nobody was declared failed
    after = committed(server, "kill")
    last = [[e["step"] for e in out if e["event"] == "checkpoint"][-1] for out in outputs]
    assert set(before) < set(after) and after[-1] == last[0] == last[1] > 290
    with server.http() as http:
        job = http.get("/v1/jobs/kill").json()
        ranks_now = http.get("/v1/jobs/kill/ranks").json()["ranks"]
    assert (job["generation"], job["failures"]) == (1, 0)
    assert [(r["step"], r["state"]) for r in ranks_now] == [(300, "finished")] * 2


def test_status_and_roll_back_commands(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkflow.cli import main

    ranks = [
        start_rank(server.url, "cli", r, 2, "--steps", "20", "--step-time", "0.02")
        for r in range(2)
    ]
    finish(ranks)

    assert main(["status", server.url, "cli", "--token", server.token or ""]) == 0
    out = capsys.readouterr().out
    assert "RANK" in out and "committed" in out and "job_created" in out
    roll_back = ["restore", "--coordinator", server.url, "--job", "cli", "--step"]
    assert main([*roll_back, "10", "--token", server.token or ""]) == 0
    assert "rolled back to step 10" in capsys.readouterr().out
    assert main([*roll_back, "15", "--token", server.token or ""]) == 2
    assert "not found" in capsys.readouterr().err
    assert main([*roll_back, "10", "--token", "wrong"]) == 2
    assert "token" in capsys.readouterr().err


def test_status_without_a_coordinator_says_what_to_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from checkflow.cli import main

    assert main(["restore", "--coordinator", "http://127.0.0.1:9", "--job", "j"]) == 3
    assert "is `checkflow serve` running" in capsys.readouterr().err
