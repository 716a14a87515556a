"""Scoped tokens against a real ``checkflow serve``: a job token acts on its own job only
(403 anywhere else, and nothing changes), the admin token on everything, the dashboard's
session reads only, and the database never holds a token in clear."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from checkflow.protocol import paths
from tests.support.coordinator import TOKEN, ServerProcess, served

pytestmark = pytest.mark.slow

PART = {"generation": 1, "nbytes": 10, "duration_s": 0.1, "manifest_path": "m"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with served(tmp_path / "c.db") as s:
        yield s


def create(http: httpx.Client, name: str, world_size: int = 1) -> str:
    """Create job ``name`` with the admin token; its job token."""
    r = http.post(paths.path(paths.JOBS), json={"name": name, "world_size": world_size})
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    assert token.startswith("cfj_") and len(token) > 40
    return str(token)


def snapshot(http: httpx.Client, job: str) -> tuple[object, ...]:
    """Everything the coordinator shows of ``job`` (read with the admin token), less the
    clock's own ``seconds_since_heartbeat``."""
    shown = [
        http.get(paths.path(p, job=job)).json()
        for p in (paths.JOB, paths.RANKS, paths.CHECKPOINTS, paths.EVENTS, paths.RESTORE_POINT)
    ]
    for rank in shown[1]["ranks"]:
        del rank["seconds_since_heartbeat"]
    return tuple(shown)


def test_job_a_token_on_job_b_is_403_on_every_route_and_changes_nothing(
    server: ServerProcess,
) -> None:
    with server.http() as admin:
        token_a = create(admin, "a")
        create(admin, "b", world_size=2)
        for rank in (0, 1):  # job b is live: two registered ranks, a part reported
            assert admin.post(paths.path(paths.REGISTER, job="b", rank=rank), json={}).is_success
        assert admin.put(paths.path(paths.PART, job="b", step=10, rank=0), json=PART).is_success
        before = snapshot(admin, "b")
        attacks = [
            ("POST", paths.FAILURE, {"rank": 1}, {"generation": 1}),
            ("POST", paths.RECOVER, {}, {}),
            ("POST", paths.COMMIT, {"step": 10}, {"rank": 0}),
            ("PUT", paths.PART, {"step": 10, "rank": 1}, PART),
            ("POST", paths.RANK_HEARTBEAT, {"rank": 0}, {"generation": 1, "step": 11}),
            ("POST", paths.NODE_HEARTBEAT, {"node": "n"}, {"ranks": []}),
            ("POST", paths.REGISTER, {"rank": 0}, {}),
            ("POST", paths.FINISH, {"rank": 0}, {}),
            ("POST", paths.JOB_TOKENS, {}, None),
            ("GET", paths.JOB, {}, None),
            ("GET", paths.RANKS, {}, None),
            ("GET", paths.EVENTS, {}, None),
        ]
        with httpx.Client(base_url=server.url, headers=bearer(token_a), timeout=5) as a:
            for method, template, values, body in attacks:
                r = a.request(method, paths.path(template, job="b", **values), json=body)
                assert r.status_code == 403, (template, r.status_code, r.text)
                assert r.json()["detail"].startswith("this token belongs to job 'a'"), r.text
            listed = a.get(paths.path(paths.JOBS))
            assert listed.status_code == 403 and "cannot list jobs" in listed.json()["detail"]
            other = a.post(paths.path(paths.JOBS), json={"name": "c", "world_size": 1})
            assert other.status_code == 403 and "cannot create job 'c'" in other.json()["detail"]
        assert snapshot(admin, "b") == before
        names = [j["name"] for j in admin.get(paths.path(paths.JOBS)).json()["jobs"]]
        assert names == ["a", "b"]


def test_a_job_token_runs_its_own_job_through_a_whole_checkpoint_and_a_rollback(
    server: ServerProcess,
) -> None:
    with server.http() as admin:
        token = create(admin, "mine")
    with httpx.Client(base_url=server.url, headers=bearer(token), timeout=5) as own:
        again = own.post(paths.path(paths.JOBS), json={"name": "mine", "world_size": 1})
        assert again.status_code == 200 and again.json()["token"] is None  # never re-issued
        assert own.post(paths.path(paths.REGISTER, job="mine", rank=0), json={}).is_success
        beat = own.post(
            paths.path(paths.RANK_HEARTBEAT, job="mine", rank=0), json={"generation": 1, "step": 3}
        )
        assert beat.status_code == 200 and beat.json()["action"] == "continue"
        part = own.put(paths.path(paths.PART, job="mine", step=10, rank=0), json=PART)
        assert part.status_code == 200 and part.json()["must_commit"] is True
        commit = own.post(paths.path(paths.COMMIT, job="mine", step=10), json={"rank": 0})
        assert commit.status_code == 200 and commit.json()["status"] == "committed"
        back = own.post(paths.path(paths.RECOVER, job="mine"), json={"step": 10})
        assert back.status_code == 200 and back.json() == {"generation": 2, "step": 10}
        assert own.get(paths.path(paths.JOB, job="mine")).json()["generation"] == 2


def test_the_admin_token_acts_on_every_job_and_issues_job_tokens(server: ServerProcess) -> None:
    with server.http() as admin:
        create(admin, "x")
        issued = admin.post(paths.path(paths.JOB_TOKENS, job="later"))
        assert issued.status_code == 201 and issued.json()["job"] == "later"
        assert issued.headers["cache-control"] == "no-store"
        assert admin.post(paths.path(paths.RECOVER, job="x"), json={}).json()["generation"] == 2
    # A token issued before its job exists creates that job, and only that one.
    with httpx.Client(base_url=server.url, headers=bearer(issued.json()["token"])) as later:
        made = later.post(paths.path(paths.JOBS), json={"name": "later", "world_size": 1})
        assert made.status_code == 201 and made.json()["token"] is None
        assert later.post(paths.path(paths.RECOVER, job="x"), json={}).status_code == 403
    assert httpx.post(f"{server.url}/v1/jobs/x/tokens").status_code == 401


def test_no_token_is_stored_in_clear_and_tokens_survive_a_restart(
    server: ServerProcess,
) -> None:
    with server.http() as admin:
        tokens = [create(admin, "a"), create(admin, "b")]
        tokens.append(admin.post(paths.path(paths.JOB_TOKENS, job="a")).json()["token"])
    server.stop()
    files = [p for p in server.db.parent.iterdir() if p.name.startswith(server.db.name)]
    raw = b"".join(p.read_bytes() for p in files)  # the database and its WAL, if any
    for token in tokens:
        assert token.encode() not in raw
        assert token.removeprefix("cfj_").encode() not in raw
    with sqlite3.connect(server.db) as db:
        stored = dict(db.execute("SELECT digest, job FROM job_tokens").fetchall())
    assert stored == {
        hashlib.sha256(tokens[0].encode()).hexdigest(): "a",
        hashlib.sha256(tokens[1].encode()).hexdigest(): "b",
        hashlib.sha256(tokens[2].encode()).hexdigest(): "a",
    }
    server.start()
    with httpx.Client(base_url=server.url, headers=bearer(tokens[2]), timeout=5) as a:
        assert a.get(paths.path(paths.JOB, job="a")).status_code == 200
        assert a.get(paths.path(paths.JOB, job="b")).status_code == 403


def test_the_dashboard_session_reads_but_changes_nothing_and_a_job_token_gets_none(
    server: ServerProcess,
) -> None:
    with server.http() as admin:
        job_token = create(admin, "s")
    with httpx.Client(base_url=server.url, timeout=5) as browser:
        refused = browser.post("/login", data={"token": job_token}, follow_redirects=False)
        assert refused.status_code == 401 and "set-cookie" not in refused.headers
        signed = browser.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert signed.status_code == 303 and browser.cookies
        assert browser.get(paths.path(paths.JOB, job="s")).status_code == 200
        r = browser.post(paths.path(paths.RECOVER, job="s"), json={})
        assert r.status_code == 401
    with server.http() as admin:
        assert admin.get(paths.path(paths.JOB, job="s")).json()["generation"] == 1
