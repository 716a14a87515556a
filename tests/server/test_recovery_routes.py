"""Failures and recoveries through the /v1 API (FastAPI's TestClient, the real detector):
crash reports from launchers, hangs found from progress, and how both show."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from checkflow_server.app import create_app
from checkflow_server.settings import Settings
from fastapi.testclient import TestClient

from checkflow.manifest import MANIFEST, step_dir
from checkflow.protocol import EventPublic
from tests.server.test_routes import beat, make_job, persist, register_all
from tests.support.coordinator import AUTH, TOKEN


def events(c: TestClient, job: str = "j") -> list[dict]:
    r = c.get(f"/v1/jobs/{job}/events")
    assert r.status_code == 200, r.text
    return r.json()["events"]


def test_a_crash_report_fails_the_rank_at_once_and_the_others_abort(client: TestClient) -> None:
    make_job(client, world=2)
    register_all(client, "j", 2)
    url = "/v1/jobs/j/ranks/1/failure"
    body = {"generation": 1, "exit_code": -9, "detail": "SIGKILL", "seconds_ago": 0.2}
    r = client.post(url, json=body)
    assert r.status_code == 200 and r.json()["state"] == "failed", r.text
    assert beat(client, "j", 0, 1, 5)["action"] == "abort"
    assert client.post(url, json=body).json()["state"] == "failed"  # idempotent
    failed = [e for e in events(client) if e["kind"] == "rank_failed"]
    assert [(e["rank"], e["detail"]["kind"], e["detail"]["detection_s"]) for e in failed] == [
        (1, "crash", 0.2)
    ]
    assert client.get("/v1/jobs/j").json()["generation"] == 2


def test_crash_reports_are_refused_as_documented(client: TestClient) -> None:
    make_job(client, world=2)
    register_all(client, "j", 2)
    ok = {"generation": 1}
    assert client.post("/v1/jobs/nope/ranks/0/failure", json=ok).status_code == 404
    assert client.post("/v1/jobs/j/ranks/2/failure", json=ok).status_code == 404
    r = client.post("/v1/jobs/j/ranks/0/failure", json={"generation": 7})
    assert r.status_code == 409 and "newer" in r.json()["detail"]
    r = client.post("/v1/jobs/j/ranks/0/failure", json={"generation": 1, "kind": "hung"})
    assert r.status_code == 422  # launchers report crashes only
    r = client.post("/v1/jobs/j/ranks/0/failure", json=ok, headers={"Authorization": ""})
    assert r.status_code == 401
    assert client.get("/v1/jobs/j").json()["generation"] == 1  # none of them had an effect


def test_a_still_rank_is_found_hung_and_the_recovery_is_measured(client: TestClient) -> None:
    job = make_job(client, world=2, hang_timeout_s=0.5)
    assert job["hang_timeout_s"] == 0.5
    register_all(client, "j", 2)
    step, start = 1, time.monotonic()
    while time.monotonic() - start < 5:
        step += 1
        a = beat(client, "j", 0, 1, step)  # rank 0 trains on
        b = beat(client, "j", 1, 1, 1)  # rank 1 beats at step 1
        if a["action"] == "abort":
            break
        time.sleep(0.05)
    found_after = time.monotonic() - start
    assert a["action"] == b["action"] == "abort"
    assert 0.5 <= found_after <= 1.5
    [hung] = [e for e in events(client) if e["kind"] == "rank_failed"]
    assert (hung["rank"], hung["detail"]["kind"]) == (1, "hung")
    assert 0.5 <= hung["detail"]["detection_s"] <= 1.5
    for r in range(2):
        assert client.post(f"/v1/jobs/j/ranks/{r}/register", json={}).json()["generation"] == 2
    beat(client, "j", 0, 2, 1)
    [trained] = [e for e in events(client) if e["kind"] == "trained_again"]
    assert trained["detail"]["fault_kind"] == "hung" and trained["detail"]["restore_step"] == 0
    assert trained["detail"]["fault_to_training_s"] > trained["detail"]["recovery_s"] > 0
    text = client.get("/metrics").text.splitlines()
    for line in (
        "checkflow_detection_latency_seconds_count 1",
        "checkflow_recovery_seconds_count 1",
        'checkflow_recovery_seconds_bucket{le="+Inf"} 1',
        "checkflow_recovery_duration_seconds_count 1",
    ):
        assert line in text


def test_a_paused_rank_is_not_hung_through_the_api(client: TestClient) -> None:
    make_job(client, world=1, hang_timeout_s=0.3)
    register_all(client, "j", 1)
    beat(client, "j", 0, 1, 2)
    start = time.monotonic()
    while time.monotonic() - start < 1.5:
        assert beat(client, "j", 0, 1, 2, paused=True)["action"] == "continue"
        time.sleep(0.1)
    assert not [e for e in events(client) if e["kind"] == "rank_failed"]


def test_the_coordinators_hang_timeout_applies_to_jobs_without_one(tmp_path: Path) -> None:
    settings = Settings(
        db=tmp_path / "c.db",
        token=TOKEN,
        sync_storage=False,
        detector_period_s=0.05,
        hang_timeout_s=0.4,
    )
    with TestClient(create_app(settings), headers=AUTH) as c:
        assert make_job(c, world=1)["hang_timeout_s"] is None
        register_all(c, "j", 1)
        beat(c, "j", 0, 1, 3)
        start = time.monotonic()
        while beat(c, "j", 0, 1, 3)["action"] != "abort":
            assert time.monotonic() - start < 3, "the server default did not apply"
            time.sleep(0.05)
        assert 0.4 <= time.monotonic() - start <= 1.5


def test_status_shows_each_recovery_with_its_fault_and_times(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkflow.cli.status import _print_recoveries

    make_job(client, world=2)
    register_all(client, "j", 2)
    client.post("/v1/jobs/j/ranks/1/failure", json={"generation": 1, "seconds_ago": 0.25})
    register_all(client, "j", 2)
    beat(client, "j", 0, 2, 1)  # trained again
    client.post("/v1/jobs/j/recover", json={})  # a roll-back: no fault, still recovering
    _print_recoveries([EventPublic.model_validate(e) for e in events(client)])
    rows = [row.split() for row in capsys.readouterr().out.splitlines()]
    assert rows[0][:3] == ["GEN", "FAULT", "RANKS"]
    gen2, gen3 = rows[1], rows[2]
    assert gen2[:5] == ["2", "crash", "1", "0.25", "-"]  # restore step: none committed
    assert float(gen2[5]) >= 0 and float(gen2[6]) == pytest.approx(float(gen2[5]) + 0.25, abs=0.01)
    assert gen3 == ["3", "-", "-", "-", "-", "recovering", "-"]


def test_a_commit_whose_report_was_lost_is_the_restore_point_of_the_next_generation(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    settings = Settings(db=tmp_path / "c.db", token=None, sync_storage=True, storage_allow=["file"])
    with TestClient(create_app(settings)) as c:
        make_job(c, world=2, storage_uri=str(root))
        register_all(c, "j", 2)
        for r in range(2):
            persist(c, "j", 10, r, 1)
        # The committer wrote MANIFEST.json and died before reporting it.
        (root / step_dir(10)).mkdir(parents=True)
        (root / step_dir(10) / MANIFEST).write_text("{}")
        c.post("/v1/jobs/j/ranks/1/failure", json={"generation": 1})
        assert c.get("/v1/jobs/j/checkpoints").json()["checkpoints"][0]["status"] == "abandoned"
        replies = register_all(c, "j", 2)
        assert [(r["generation"], r["restore_step"]) for r in replies] == [(2, 10), (2, 10)]
        [ck] = c.get("/v1/jobs/j/checkpoints").json()["checkpoints"]
        assert (ck["step"], ck["status"]) == (10, "committed")


def test_a_roll_back_is_not_undone_by_a_commit_found_later(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    settings = Settings(db=tmp_path / "c.db", token=None, sync_storage=True, storage_allow=["file"])
    with TestClient(create_app(settings)) as c:
        make_job(c, world=1, storage_uri=str(root))
        register_all(c, "j", 1)
        persist(c, "j", 10, 0, 1)
        c.post("/v1/jobs/j/checkpoints/10/commit", json={"rank": 0})
        persist(c, "j", 20, 0, 1)
        for step in (10, 20):  # step 20's commit landed right after the roll-back
            (root / step_dir(step)).mkdir(parents=True)
            (root / step_dir(step) / MANIFEST).write_text("{}")
        assert c.post("/v1/jobs/j/recover", json={"step": 10}).json()["step"] == 10
        assert register_all(c, "j", 1)[0]["restore_step"] == 10
