"""Coordinator replicas on one real PostgreSQL (issue 33): real ``checkflow serve``
processes, real HTTP, real SIGKILLs; ``tests/support/replicas.py`` starts them.

Replica ``a`` creates the job, so ``a`` serves it (holds its lease); ``b`` answers every
request for it with a 307 to ``a`` until ``a`` stops renewing the lease, then takes it over.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa
from checkflow_server.repository import migrate
from checkflow_server.repository.database import Database

from checkflow.protocol import paths
from tests.support.coordinator import AUTH, ServerProcess
from tests.support.postgres import Cluster, remove_cluster, start_cluster
from tests.support.replicas import replica, replicas, start_together

JOB = "llama"
FAILOVER_S = 15.0
"""The issue's bound: another replica serves the job this soon after its owner died."""


def _client(url: str, *, follow: bool = True) -> httpx.Client:
    """A client of ``url`` that follows 307s with its token: httpx drops ``Authorization``
    on a redirect to another origin (another port is one), a request hook puts it back."""

    def token(request: httpx.Request) -> None:
        request.headers.update(AUTH)

    hooks = {"request": [token]}
    return httpx.Client(base_url=url, timeout=10, follow_redirects=follow, event_hooks=hooks)


def v1(template: str, **values: str | int) -> str:
    return paths.path(template, **values)


def _train(url: str, *, world: int = 2, heartbeat_timeout_s: float = 60) -> None:
    """A job of ``world`` ranks registered, with step 10 committed and step 20 in flight."""
    with _client(url) as c:
        body = {"name": JOB, "world_size": world, "heartbeat_timeout_s": heartbeat_timeout_s}
        assert c.post(v1(paths.JOBS), json=body).status_code in (200, 201)
        for r in range(world):
            reply = c.post(v1(paths.REGISTER, job=JOB, rank=r), json={"instance": f"p{r}"})
            assert reply.status_code == 200, reply.text
        for step in (10, 20):
            for r in range(world if step == 10 else 1):
                part = {"generation": 1, "nbytes": 100, "duration_s": 0.1, "manifest_path": "m"}
                reply = c.put(v1(paths.PART, job=JOB, step=step, rank=r), json=part)
                assert reply.status_code == 200, reply.text
        commit = {"rank": 0, "generation": 1}
        reply = c.post(v1(paths.COMMIT, job=JOB, step=10), json=commit)
        assert reply.status_code == 200, reply.text


def _state(url: str) -> dict[str, object]:
    """What must survive a failover, as one replica serves it."""
    with _client(url, follow=False) as c:
        job = c.get(v1(paths.JOB, job=JOB))
        assert job.status_code == 200, job.text
        ckpts = c.get(v1(paths.CHECKPOINTS, job=JOB)).json()["checkpoints"]
        ranks = c.get(v1(paths.RANKS, job=JOB)).json()["ranks"]
        point = c.get(v1(paths.RESTORE_POINT, job=JOB)).json()
        events = c.get(v1(paths.EVENTS, job=JOB)).json()["events"]
    return {
        "generation": job.json()["generation"],
        "checkpoints": sorted((k["step"], k["status"]) for k in ckpts),
        "ranks": [(r["rank"], r["generation"], r["state"]) for r in ranks],
        "restore_step": point["step"],
        "events": [(e["id"], e["kind"]) for e in events],
    }


@pytest.fixture
def two(pg_url: str) -> Iterator[list[ServerProcess]]:
    with replicas(pg_url, 2) as both:
        yield both


def test_any_replica_answers_for_any_job_by_a_307_to_its_owner(
    two: list[ServerProcess],
) -> None:
    a, b = two
    _train(a.url)
    with _client(b.url, follow=False) as c:
        reply = c.get(v1(paths.JOB, job=JOB), params={"x": "1"})
        assert reply.status_code == 307
        assert reply.headers["location"] == f"{a.url}{v1(paths.JOB, job=JOB)}?x=1"
        beat = c.post(v1(paths.RANK_HEARTBEAT, job=JOB, rank=0), json={"generation": 1, "step": 5})
        assert beat.status_code == 307  # the fast path hands it over, FastAPI redirects
        assert c.get(v1(paths.JOB, job="nope")).status_code == 404
        again = {"name": JOB, "world_size": 2}  # a launcher re-opening the job through b
        assert c.post(v1(paths.JOBS), json=again).status_code == 307
        listed = c.get(v1(paths.JOBS))  # a list is read from the database, any replica
        assert listed.status_code == 200 and [j["name"] for j in listed.json()["jobs"]] == [JOB]
    assert _state(a.url) == _state_following(b.url)  # the same state through either
    with _client(b.url) as c:  # a write through b lands at a (307 keeps method and body)
        reply = c.post(v1(paths.RECOVER, job=JOB), json={"step": 10})
        assert reply.status_code == 200, reply.text
    assert _state(a.url)["generation"] == 2


def _state_following(url: str) -> dict[str, object]:
    with _client(url) as c:
        final = c.get(v1(paths.JOB, job=JOB))
    return _state(str(final.url).split("/v1/")[0])


def _wait_served(server: ServerProcess, timeout: float) -> float:
    """Seconds until ``server`` answers the job itself (200, not a 307)."""
    start = time.monotonic()
    with _client(server.url, follow=False) as c:
        while True:
            if c.get(v1(paths.JOB, job=JOB)).status_code == 200:
                return time.monotonic() - start
            assert time.monotonic() - start < timeout, f"not served in {timeout} s"
            time.sleep(0.1)


def test_after_a_sigkill_of_the_owner_the_other_serves_the_job_with_all_its_state(
    two: list[ServerProcess],
) -> None:
    a, b = two
    _train(a.url)
    before = _state(a.url)
    a.kill()
    took = _wait_served(b, FAILOVER_S)
    after = _state(b.url)
    assert after == before, (before, after)
    assert after["checkpoints"] == [(10, "committed"), (20, "in_progress")]
    assert after["restore_step"] == 10
    print(f"failover: served by the other replica {took:.1f} s after the SIGKILL")


def test_a_silent_rank_is_detected_by_the_new_owner(two: list[ServerProcess]) -> None:
    a, b = two
    _train(a.url, heartbeat_timeout_s=2)
    stop = threading.Event()

    def rank1_beats() -> None:  # rank 1 trains on through the failover; rank 0 is gone
        with _client(b.url) as c:
            while not stop.is_set():
                # A TransportError: the redirect went to the killed owner.
                with contextlib.suppress(httpx.TransportError):
                    c.post(
                        v1(paths.RANK_HEARTBEAT, job=JOB, rank=1),
                        json={"generation": 1, "step": 30},
                    )
                stop.wait(0.3)

    beats = threading.Thread(target=rank1_beats, daemon=True)
    beats.start()
    try:
        start = time.monotonic()
        a.kill()
        deadline = start + FAILOVER_S + 10
        failed: list[int] = []
        with _client(b.url, follow=False) as c:
            while not failed:
                assert time.monotonic() < deadline, "the silent rank was not detected"
                reply = c.get(v1(paths.EVENTS, job=JOB), params={"kinds": "rank_failed"})
                if reply.status_code == 200:
                    failed = [
                        e["rank"] for e in reply.json()["events"] if e["kind"] == "rank_failed"
                    ]
                time.sleep(0.2)
        print(
            f"failover: silent rank detected by the new owner "
            f"{time.monotonic() - start:.1f} s after the SIGKILL"
        )
        assert failed == [0]
        assert _state(b.url)["generation"] == 2  # the job moved on: recovery is under way
    finally:
        stop.set()
        beats.join(10)


def test_both_replicas_restarted_have_all_the_state(two: list[ServerProcess]) -> None:
    a, b = two
    _train(a.url)
    before = _state(a.url)
    a.kill()
    b.kill()
    a.start()  # same port, same advertised URL: a takes its jobs back at once
    b.start()
    assert _wait_served(a, FAILOVER_S) < FAILOVER_S
    assert _state(a.url) == before
    with _client(b.url, follow=False) as c:
        assert c.get(v1(paths.JOB, job=JOB)).status_code == 307


def test_two_replicas_started_at_once_on_an_empty_database_both_serve(pg_url: str) -> None:
    servers = [replica(pg_url), replica(pg_url)]
    try:
        start_together(servers)
        _train(servers[1].url)
        assert _state(servers[0].url.replace(servers[0].url, servers[1].url))["restore_step"] == 10
        db = Database(pg_url)
        assert migrate.current(db) == migrate.head()
        with db.transaction() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar() == 1
        db.close()
    finally:
        for s in servers:
            s.stop()


def test_with_the_database_down_writes_get_503_and_work_again_once_it_is_back() -> None:
    cluster: Cluster = start_cluster()  # its own: this test stops it
    try:
        with replicas(cluster.new_database(), 1) as (a,):
            _train(a.url)
            cluster.stop("immediate")
            with _client(a.url, follow=False) as c:
                beat = c.post(
                    v1(paths.RANK_HEARTBEAT, job=JOB, rank=0), json={"generation": 1, "step": 11}
                )
                assert beat.status_code == 200  # held in memory: training goes on
                part = {"generation": 1, "nbytes": 7, "duration_s": 0.1, "manifest_path": "m"}
                report = v1(paths.PART, job=JOB, step=30, rank=0)
                reply = c.put(report, json=part)  # a write: refused, nothing half done
                assert reply.status_code == 503 and "database" in reply.json()["detail"]
                cluster.start()
                deadline = time.monotonic() + 30
                while (reply := c.put(report, json=part)).status_code != 200:
                    assert time.monotonic() < deadline, reply.text
                    time.sleep(0.2)
            assert _state(a.url)["restore_step"] == 10
    finally:
        remove_cluster(cluster)
