"""The /v1 API through FastAPI's TestClient: each rule of the coordinator, one test."""

from __future__ import annotations

import time
from pathlib import Path

from checkflow_server.app import create_app
from checkflow_server.settings import Settings
from fastapi.testclient import TestClient

from checkflow.interval import Profile, choose_interval
from checkflow.manifest import MANIFEST, step_dir
from tests.support.coordinator import AUTH


def make_job(c: TestClient, name: str = "j", world: int = 2, **kw: object) -> dict:
    r = c.post("/v1/jobs", json={"name": name, "world_size": world, **kw})
    assert r.status_code in (200, 201), r.text
    return r.json()


def register_all(c: TestClient, name: str, world: int) -> list[dict]:
    return [c.post(f"/v1/jobs/{name}/ranks/{r}/register", json={}).json() for r in range(world)]


def beat(c: TestClient, name: str, rank: int, gen: int, step: int, **kw: float) -> dict:
    """The heartbeat's reply. One of an ended generation is refused (409, fenced); it is
    returned as the client reads it: ``{"action": "abort", "status": 409, "detail": ...}``."""
    r = c.post(
        f"/v1/jobs/{name}/ranks/{rank}/heartbeat", json={"generation": gen, "step": step, **kw}
    )
    if r.status_code == 409 and "ended: the job moved to generation" in r.json()["detail"]:
        return {"action": "abort", "status": 409, "detail": r.json()["detail"]}
    assert r.status_code == 200, r.text
    return r.json()


def retune(c: TestClient) -> None:
    """Retune now, on the app's event loop: the coordinator's state and its SQLite
    connection belong to that thread (the detector uses them there at the same time)."""
    assert c.portal is not None, "retune needs a started app: use the TestClient in `with`"
    c.portal.call(c.app.state.coordinator.retune)


class ManualClock:
    """A clock the test moves by hand, for the coordinator's ages and durations."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def persist(c: TestClient, name: str, step: int, rank: int, gen: int) -> dict:
    r = c.put(
        f"/v1/jobs/{name}/checkpoints/{step}/ranks/{rank}",
        json={
            "generation": gen,
            "nbytes": 100,
            "duration_s": 0.1,
            "manifest_path": f"{step_dir(step)}/rank-{rank:05d}.json",
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def commit_step(c: TestClient, name: str, step: int, world: int, gen: int) -> None:
    replies = [persist(c, name, step, r, gen) for r in range(world)]
    committer = [r for r, reply in enumerate(replies) if reply["must_commit"]]
    assert len(committer) == 1
    assert (
        c.post(
            f"/v1/jobs/{name}/checkpoints/{step}/commit", json={"rank": committer[0]}
        ).status_code
        == 200
    )


def test_create_job_returns_existing_by_name(client: TestClient) -> None:
    r1 = client.post("/v1/jobs", json={"name": "run-1", "world_size": 4})
    r2 = client.post("/v1/jobs", json={"name": "run-1", "world_size": 4, "max_overhead": 0.5})
    assert (r1.status_code, r2.status_code) == (201, 200)
    assert r2.json()["max_overhead"] == 0.035 and r2.json()["created"] == r1.json()["created"]
    assert [j["name"] for j in client.get("/v1/jobs").json()["jobs"]] == ["run-1"]
    assert client.get("/v1/jobs/run-1").json()["world_size"] == 4


def test_missing_or_wrong_token_is_401_without_effect(client: TestClient) -> None:
    body = {"name": "x", "world_size": 1}
    assert client.post("/v1/jobs", json=body, headers={"Authorization": ""}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/v1/jobs", json=body, headers=wrong).status_code == 401
    # A bad body without the token is still 401: the caller learns nothing about the API.
    r = client.post(
        "/v1/jobs", content=b"{oops", headers={**wrong, "content-type": "application/json"}
    )
    assert r.status_code == 401
    assert client.get("/v1/jobs").json()["jobs"] == []
    assert client.get("/healthz", headers={"Authorization": ""}).json() == {
        "status": "ok",
        "jobs": 0,
    }


def test_malformed_input_is_422_naming_the_field(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={"name": "ok", "world_size": 0})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "world_size"]
    make_job(client)
    r = client.post("/v1/jobs/j/ranks/0/heartbeat", json={"generation": 1, "step": -3})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "step"]
    r = client.post("/v1/jobs/j/ranks/-1/register", json={})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "rank"]


def test_unknown_job_rank_or_step_is_404(client: TestClient) -> None:
    assert client.get("/v1/jobs/nope").status_code == 404
    make_job(client, world=2)
    assert client.post("/v1/jobs/j/ranks/2/register", json={}).status_code == 404
    assert client.post("/v1/jobs/j/checkpoints/5/commit", json={}).status_code == 404
    # The job exists: a step in the body that is no committed checkpoint conflicts with it.
    assert client.post("/v1/jobs/j/recover", json={"step": 5}).status_code == 409


def test_every_rank_gets_the_same_next_checkpoint_step(client: TestClient) -> None:
    make_job(client, world=4)
    regs = register_all(client, "j", 4)
    assert {(r["generation"], r["next_checkpoint_step"], r["restore_step"]) for r in regs} == {
        (1, 10, None)
    }
    replies = [beat(client, "j", r, 1, step) for r, step in enumerate([3, 4, 4, 5])]
    assert {r["next_checkpoint_step"] for r in replies[-1:]} == {10}
    assert all(r["action"] == "continue" for r in replies)
    replies = [beat(client, "j", r, 1, 12) for r in range(4)]
    assert {r["next_checkpoint_step"] for r in replies} == {20}


def test_node_heartbeat_carries_local_ranks(client: TestClient) -> None:
    make_job(client, world=4)
    register_all(client, "j", 4)
    body = {"ranks": [{"rank": r, "generation": 1, "step": 7, "iteration_s": 0.2} for r in (2, 3)]}
    reply = client.post("/v1/jobs/j/nodes/host-b/heartbeat", json=body).json()
    assert reply["ranks"] == [{"rank": 2, "action": "continue"}, {"rank": 3, "action": "continue"}]
    ranks = client.get("/v1/jobs/j/ranks").json()["ranks"]
    assert [(r["node"], r["step"], r["iteration_s"]) for r in ranks[2:]] == [("host-b", 7, 0.2)] * 2
    # One bad rank in the batch: 404 and nothing of the batch recorded.
    bad = {
        "ranks": [{"rank": 0, "generation": 1, "step": 9}, {"rank": 9, "generation": 1, "step": 9}]
    }
    assert client.post("/v1/jobs/j/nodes/host-a/heartbeat", json=bad).status_code == 404
    assert client.get("/v1/jobs/j/ranks").json()["ranks"][0]["step"] == 0


def test_exactly_one_rank_commits_and_restore_point_follows(client: TestClient) -> None:
    make_job(client, world=3)
    register_all(client, "j", 3)
    first = [persist(client, "j", 10, r, 1) for r in range(3)]
    assert [r["must_commit"] for r in first] == [False, False, True]
    assert persist(client, "j", 10, 2, 1)["must_commit"] is True  # a retry is answered the same
    assert client.get("/v1/jobs/j/restore-point").json() == {"generation": 1, "step": None}
    client.post("/v1/jobs/j/checkpoints/10/commit", json={"rank": 2})
    assert client.get("/v1/jobs/j/restore-point").json() == {"generation": 1, "step": 10}
    persist(client, "j", 20, 0, 1)
    cks = client.get("/v1/jobs/j/checkpoints").json()["checkpoints"]
    assert [(c["step"], c["status"], c["persisted_ranks"]) for c in cks] == [
        (20, "in_progress", 1),
        (10, "committed", 3),
    ]


def test_reregistration_after_crash_fails_the_job_and_others_abort(client: TestClient) -> None:
    make_job(client, world=2)
    register_all(client, "j", 2)
    commit_step(client, "j", 10, 2, 1)
    persist(client, "j", 20, 0, 1)
    again = client.post("/v1/jobs/j/ranks/1/register", json={}).json()
    assert (again["generation"], again["restore_step"], again["next_checkpoint_step"]) == (
        2,
        10,
        20,
    )
    assert beat(client, "j", 0, 1, 21)["action"] == "abort"
    assert client.post("/v1/jobs/j/ranks/0/register", json={}).json()["restore_step"] == 10
    assert beat(client, "j", 0, 2, 11)["action"] == "continue"
    statuses = {
        c["step"]: c["status"] for c in client.get("/v1/jobs/j/checkpoints").json()["checkpoints"]
    }
    assert statuses == {10: "committed", 20: "abandoned"}
    events = client.get("/v1/jobs/j/events").json()["events"]
    kinds = [e["kind"] for e in events]
    assert kinds == [
        "job_created",
        "rank_failed",
        "generation_started",
        "recovered",
        "trained_again",
    ]
    assert events[1]["detail"]["kind"] == "re_registered"
    trained = events[-1]["detail"]
    assert (trained["fault_kind"], trained["restore_step"], trained["step"]) == (
        "re_registered",
        10,
        11,
    )


def test_same_instance_registering_twice_is_a_retry_not_a_crash(client: TestClient) -> None:
    make_job(client, world=1)
    a = client.post("/v1/jobs/j/ranks/0/register", json={"instance": "p1"}).json()
    b = client.post("/v1/jobs/j/ranks/0/register", json={"instance": "p1"}).json()
    assert a["generation"] == b["generation"] == 1


def test_stale_generation_is_409(client: TestClient) -> None:
    make_job(client, world=1)
    register_all(client, "j", 1)
    assert (
        client.post("/v1/jobs/j/ranks/0/heartbeat", json={"generation": 2, "step": 1}).status_code
        == 409
    )
    client.post("/v1/jobs/j/recover", json={})
    r = client.put(
        "/v1/jobs/j/checkpoints/10/ranks/0",
        json={"generation": 1, "nbytes": 1, "duration_s": 0, "manifest_path": "m"},
    )
    assert r.status_code == 409 and "generation" in r.json()["detail"]


def test_silent_rank_is_declared_failed_within_timeout_plus_one_second(client: TestClient) -> None:
    make_job(client, world=2, heartbeat_timeout_s=0.5)
    register_all(client, "j", 2)
    start = time.time()
    while time.time() - start < 3:
        reply = beat(client, "j", 0, 1, 1)
        if reply["action"] == "abort":
            break
        time.sleep(0.05)
    assert reply["action"] == "abort"
    failed = [
        e for e in client.get("/v1/jobs/j/events").json()["events"] if e["kind"] == "rank_failed"
    ]
    assert [e["rank"] for e in failed] == [1]
    assert 0.5 <= failed[0]["detail"]["silent_s"] <= 1.5
    assert client.get("/v1/jobs/j").json()["failures"] == 1


def test_recover_rolls_back_to_a_committed_step(client: TestClient) -> None:
    make_job(client, world=2)
    register_all(client, "j", 2)
    commit_step(client, "j", 10, 2, 1)
    commit_step(client, "j", 20, 2, 1)
    r = client.post("/v1/jobs/j/recover", json={"step": 10}).json()
    assert r == {"generation": 2, "step": 10}
    assert beat(client, "j", 0, 1, 25)["action"] == "abort"
    assert client.post("/v1/jobs/j/ranks/0/register", json={}).json()["restore_step"] == 10
    persist(client, "j", 30, 0, 2)
    assert client.post("/v1/jobs/j/recover", json={"step": 30}).status_code == 409


def test_interval_follows_the_slowest_rank_under_the_budget(settings: Settings) -> None:
    # The detector's periodic retune is pushed out of this test's way: one that ran between
    # the two ranks' first heartbeats would schedule rank 0's interval alone, and the
    # explicit retune below would then wait for that change to take effect (a flake seen
    # under CI load: 6 instead of 20).
    quiet = settings.model_copy(update={"retune_period_s": 60})
    with TestClient(create_app(quiet), headers=AUTH) as client:
        _interval_follows_the_slowest_rank(client)


def _interval_follows_the_slowest_rank(client: TestClient) -> None:
    make_job(client, world=2, max_overhead=0.035)
    register_all(client, "j", 2)
    beat(client, "j", 0, 1, 1, iteration_s=0.05, stall_s=0.01, persist_s=0.2)
    beat(client, "j", 1, 1, 1, iteration_s=0.1, stall_s=0.07, persist_s=0.5)
    retune(client)
    expected = choose_interval(Profile(iteration_s=0.1, cost_s=0.07, persist_s=0.5))
    assert expected == 20
    reply = beat(client, "j", 0, 1, 2)
    assert reply["interval"] == 20
    # The change counts from the newest checkpoint (none: step 0) at once: the ranks adopt
    # it at their next due step (10, on the old interval) at the latest.
    assert reply["schedule"] == {"anchor": 0, "interval": 20, "mode": "tuned"}
    assert reply["next_checkpoint_step"] == 20
    change = client.get("/v1/jobs/j/events").json()["events"][-1]
    assert change["kind"] == "interval_changed"
    assert change["detail"] == {
        "old_interval": 10,
        "interval": 20,
        "from_step": 10,
        "iteration_s": 0.1,
        "cost_s": 0.07,
        "persist_s": 0.5,
        "mtbf_s": None,
        "max_overhead": 0.035,
    }


def test_observed_failures_bound_the_interval_by_young_daly(client: TestClient) -> None:
    # The MTBF is the job's age over its failures, so the test sets the coordinator's clock:
    # on the wall clock an age near 0.1 s gave a Young/Daly interval of 10, the warmup
    # interval itself, hence no change and no event (a flake under load). The clock moves
    # before the first measurements, so a retune by the detector would decide the same.
    clock = ManualClock(1_000.0)
    client.app.state.coordinator.clock = clock
    make_job(client, world=1, max_overhead=0.01, heartbeat_timeout_s=60)
    register_all(client, "j", 1)
    client.post("/v1/jobs/j/ranks/0/register", json={})  # a crash: one failure observed
    clock.now += 40.0  # MTBF: 40 s of the job's life / 1 failure
    beat(client, "j", 0, 2, 1, iteration_s=0.01, stall_s=0.05, persist_s=0.0)
    retune(client)
    change = client.get("/v1/jobs/j/events").json()["events"][-1]
    assert change["kind"] == "interval_changed"
    assert change["detail"]["mtbf_s"] == 40.0
    budget_only = choose_interval(
        Profile(iteration_s=0.01, cost_s=0.05, persist_s=0.0), max_overhead=0.01
    )
    bounded = choose_interval(
        Profile(iteration_s=0.01, cost_s=0.05, persist_s=0.0), max_overhead=0.01, mtbf_s=40.0
    )
    # sqrt(2 * 0.05 s * 40 s) = 2 s = 200 steps of 0.01 s, under the budget's 500.
    assert change["detail"]["interval"] == bounded == 200 < budget_only == 500


def test_state_survives_a_new_app_on_the_same_database(settings: Settings) -> None:
    with TestClient(create_app(settings), headers=AUTH) as c:
        make_job(c, world=2)
        register_all(c, "j", 2)
        commit_step(c, "j", 10, 2, 1)
        beat(c, "j", 0, 1, 12, iteration_s=0.1)
    with TestClient(create_app(settings), headers=AUTH) as c:
        job = c.get("/v1/jobs/j").json()
        assert (job["generation"], job["restore_step"], job["ranks_alive"]) == (1, 10, 2)
        assert c.get("/v1/jobs/j/ranks").json()["ranks"][0]["step"] == 12
        assert beat(c, "j", 1, 1, 12)["action"] == "continue"
        assert [e["kind"] for e in c.get("/v1/jobs/j/events").json()["events"]] == ["job_created"]


def test_committed_checkpoints_are_learned_from_storage(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (5, 15):
        (root / step_dir(step)).mkdir(parents=True)
        (root / step_dir(step) / MANIFEST).write_text("{}")
    (root / step_dir(25)).mkdir()  # never committed
    settings = Settings(db=tmp_path / "c.db", token=None, sync_storage=True, storage_allow=["file"])
    with TestClient(create_app(settings)) as c:
        make_job(c, world=1, storage_uri=str(root))
        deadline = time.time() + 5
        while c.get("/v1/jobs/j/restore-point").json()["step"] is None and time.time() < deadline:
            time.sleep(0.02)
        assert c.get("/v1/jobs/j/restore-point").json()["step"] == 15
        cks = c.get("/v1/jobs/j/checkpoints").json()["checkpoints"]
        assert [(ck["step"], ck["source"]) for ck in cks] == [(15, "storage"), (5, "storage")]


def test_metrics_are_prometheus_text(client: TestClient) -> None:
    make_job(client, world=2)
    register_all(client, "j", 2)
    beat(client, "j", 0, 1, 1)
    commit_step(client, "j", 10, 2, 1)
    text = client.get("/metrics").text
    for line in (
        "checkflow_jobs 1",
        'checkflow_ranks_alive{checkflow_job="j"} 2',
        'checkflow_ranks_finished{checkflow_job="j"} 0',
        'checkflow_latest_checkpoint_step{checkflow_job="j"} 10',
        "checkflow_heartbeats_total 1",
        "checkflow_checkpoints_committed_total 1",
        "checkflow_failures_detected_total 0",
        "checkflow_recovery_duration_seconds_count 0",
    ):
        assert line in text.splitlines()


def test_fast_path_and_routed_heartbeats_answer_the_same(client: TestClient) -> None:
    make_job(client, world=2)
    register_all(client, "j", 2)
    # "bearer" in lower case is valid but skips the fast path: FastAPI's route answers.
    routed = {"Authorization": AUTH["Authorization"].replace("Bearer", "bearer")}
    body = {"generation": 1, "step": 3, "iteration_s": 0.5}
    fast = client.post("/v1/jobs/j/ranks/0/heartbeat", json=body)
    slow = client.post("/v1/jobs/j/ranks/1/heartbeat", json=body, headers=routed)
    assert fast.status_code == slow.status_code == 200
    assert fast.json() == slow.json()
    node = {"ranks": [{"rank": 0, "generation": 1, "step": 4}]}
    fast = client.post("/v1/jobs/j/nodes/a/heartbeat", json=node)
    slow = client.post("/v1/jobs/j/nodes/a/heartbeat", json=node, headers=routed)
    assert fast.json() == slow.json()
    assert [r["step"] for r in client.get("/v1/jobs/j/ranks").json()["ranks"]] == [4, 3]
