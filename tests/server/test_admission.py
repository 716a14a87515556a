"""What a request must pass before its body is read (``api/admission.py``), against the app
in-process: the decision alone, the login rate limit, the caps, non-finite numbers and the
docs routes. ``test_hostile_clients.py`` sends the same attacks to a real ``checkflow serve``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from checkflow_server.api.admission import Head, Limits, Refusal, decide
from checkflow_server.api.auth import ADMIN, Keys, Principal
from checkflow_server.api.ratelimit import LoginLimiter
from checkflow_server.app import create_app
from checkflow_server.settings import Settings
from fastapi.testclient import TestClient

from tests.support.coordinator import AUTH, TOKEN

KEYS = Keys(admin=TOKEN, job_of=lambda t: "mine" if t == "cfj_mine" else None)
LIMITS = Limits(keys=KEYS, docs=False, max_body_bytes=1 << 20, max_login_bytes=16 << 10)


def _head(path: str = "/v1/jobs", method: str = "POST", **kw: object) -> Head:
    fields: dict = {"client": "10.0.0.1", "authorization": None, "cookie": None}
    fields["content_length"] = None
    fields.update(kw)
    return Head(method=method, path=path, **fields)


# --- the decision alone --------------------------------------------------------------------
def test_no_token_is_401_before_the_declared_length_is_even_looked_at() -> None:
    refusal = decide(LIMITS, LoginLimiter(10, 6), _head(content_length=1 << 40), 0.0)
    assert refusal is not None and refusal.status == 401
    assert (b"www-authenticate", b"Bearer") in refusal.headers


def test_with_the_token_a_declared_length_over_the_cap_is_413_and_at_the_cap_passes() -> None:
    auth = f"Bearer {TOKEN}"
    over = decide(
        LIMITS, LoginLimiter(10, 6), _head(authorization=auth, content_length=(1 << 20) + 1), 0
    )
    assert over is not None and over.status == 413 and str(1 << 20) in over.detail
    at = decide(LIMITS, LoginLimiter(10, 6), _head(authorization=auth, content_length=1 << 20), 0)
    assert at == ADMIN


def test_login_has_its_own_smaller_cap_and_needs_no_token() -> None:
    limiter = LoginLimiter(10, 6)
    assert decide(LIMITS, limiter, _head("/login", content_length=16 << 10), 0) is None
    refusal = decide(LIMITS, limiter, _head("/login", content_length=(16 << 10) + 1), 0)
    assert refusal is not None and refusal.status == 413


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/jobs/other/ranks/0/failure"),
        ("POST", "/v1/jobs/other/recover"),
        ("POST", "/v1/jobs/other/checkpoints/5/commit"),
        ("PUT", "/v1/jobs/other/checkpoints/5/ranks/0"),
        ("POST", "/v1/jobs/other/ranks/0/heartbeat"),
        ("GET", "/v1/jobs/other"),
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs/mine/tokens"),
        ("POST", "/v1/jobs/other/tokens"),
        ("POST", "/v1/jobs/mine/tokens/more"),
        ("GET", "/v1/jobs/mine-too"),
        ("GET", "/v1/jobs/"),
        ("GET", "/v1/health"),
    ],
)
def test_a_job_token_is_403_off_its_own_job_before_the_body_is_read(method: str, path: str) -> None:
    head = _head(path, method, authorization="Bearer cfj_mine", content_length=1 << 40)
    refusal = decide(LIMITS, LoginLimiter(10, 6), head, 0)
    assert isinstance(refusal, Refusal) and refusal.status == 403, refusal


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/mine"),
        ("POST", "/v1/jobs/mine/recover"),
        ("POST", "/v1/jobs/mine/ranks/3/heartbeat"),
        ("POST", "/v1/jobs/mine/checkpoints/5/commit"),
    ],
)
def test_a_job_token_acts_on_its_own_job(method: str, path: str) -> None:
    head = _head(path, method, authorization="Bearer cfj_mine")
    assert decide(LIMITS, LoginLimiter(10, 6), head, 0) == Principal("job", True, "mine")


def test_an_unknown_job_token_is_401_like_any_wrong_token() -> None:
    head = _head("/v1/jobs/mine", "GET", authorization="Bearer cfj_guess")
    refusal = decide(LIMITS, LoginLimiter(10, 6), head, 0)
    assert isinstance(refusal, Refusal) and refusal.status == 401


def test_health_metrics_and_the_page_need_no_token_and_openapi_only_when_served() -> None:
    limiter = LoginLimiter(10, 6)
    for path in ("/healthz", "/metrics", "/", "/dashboard/app.js", "/openapi.json"):
        assert decide(LIMITS, limiter, _head(path, "GET"), 0) is None, path
    docs = Limits(KEYS, True, 1 << 20, 16 << 10)
    refusal = decide(docs, limiter, _head("/openapi.json", "GET"), 0)
    assert refusal is not None and refusal.status == 401


def test_a_bucket_empties_after_n_wrong_tokens_and_refills_one_try_per_period() -> None:
    limiter = LoginLimiter(capacity=3, refill_s=6.0)
    for _ in range(3):
        assert limiter.retry_after("a", 100.0) is None
        limiter.failed("a", 100.0)
    assert limiter.retry_after("a", 100.0) == 6
    assert limiter.retry_after("a", 103.0) == 3
    assert limiter.retry_after("b", 100.0) is None  # another address has its own bucket
    assert limiter.retry_after("a", 106.0) is None  # one try came back
    limiter.failed("a", 106.0)
    assert limiter.retry_after("a", 106.0) == 6


def test_the_table_of_addresses_is_bounded_forgetting_the_oldest_failure() -> None:
    limiter = LoginLimiter(capacity=1, refill_s=60.0, max_addresses=100)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(limiter._buckets) == 100
    assert limiter.retry_after("10.0.0.0", 0.0) is None  # forgotten: a full bucket again
    assert limiter.retry_after("10.0.3.231", 0.0) == 60  # the newest is still limited


# --- the app -----------------------------------------------------------------------------------
def _app(tmp_path: Path, **settings: object) -> TestClient:
    options: dict = {"db": tmp_path / "c.db", "token": TOKEN, "sync_storage": False}
    options.update(settings)
    return TestClient(create_app(Settings(**options)), base_url="http://127.0.0.1")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with _app(tmp_path) as c:
        yield c


def test_a_bad_body_without_a_token_is_401_not_a_description_of_the_body(
    client: TestClient,
) -> None:
    for body in (b"{not json", b'{"name": NaN}', b"[" * 10_000):
        r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 401 and "token" in r.json()["detail"], body[:20]
    assert client.get("/v1/jobs", headers=AUTH).json()["jobs"] == []


def test_a_chunked_body_over_the_cap_is_413_and_changes_nothing(tmp_path: Path) -> None:
    with _app(tmp_path, max_body_bytes=4096) as client:
        chunks = iter([b'{"name": "big", "world_size": 1, "storage_uri": "', b"x" * 8192, b'"}'])
        r = client.post(
            "/v1/jobs", content=chunks, headers={**AUTH, "content-type": "application/json"}
        )
        assert r.status_code == 413 and "4096" in r.json()["detail"]
        assert r.headers["connection"] == "close"
        assert client.get("/v1/jobs", headers=AUTH).json()["jobs"] == []
        small = client.post("/v1/jobs", json={"name": "ok", "world_size": 1}, headers=AUTH)
        assert small.status_code == 201


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_non_finite_numbers_are_422_on_every_route_that_takes_numbers(
    client: TestClient, number: str
) -> None:
    assert client.post("/v1/jobs", json={"name": "j", "world_size": 1}, headers=AUTH).is_success
    assert client.post("/v1/jobs/j/ranks/0/register", json={}, headers=AUTH).is_success
    bodies = {
        "/v1/jobs": f'{{"name": "k", "world_size": 1, "max_overhead": {number}}}',
        "/v1/jobs/j/ranks/0/heartbeat": f'{{"generation": 1, "step": 1, "iteration_s": {number}}}',
        "/v1/jobs/j/nodes/n/heartbeat": (
            f'{{"ranks": [{{"rank": 0, "generation": 1, "step": 1, "stall_s": {number}}}]}}'
        ),
        "/v1/jobs/j/ranks/0/failure": f'{{"generation": 1, "seconds_ago": {number}}}',
        "/v1/jobs/j/recover": f'{{"step": {number}}}',
    }
    for path, body in bodies.items():
        r = client.post(path, content=body, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 422, (path, r.status_code, r.text)
        (error,) = r.json()["detail"]
        assert error["type"] == "json_invalid" and number.lstrip("-") in error["ctx"]["error"]
    (rank,) = client.get("/v1/jobs/j/ranks", headers=AUTH).json()["ranks"]
    assert rank["iteration_s"] is None and rank["state"] == "alive"
    assert [j["name"] for j in client.get("/v1/jobs", headers=AUTH).json()["jobs"]] == ["j"]


def test_login_answers_429_with_retry_after_once_an_address_is_out_of_tries(
    tmp_path: Path,
) -> None:
    with _app(tmp_path, login_attempts=3, login_refill_s=60) as client:
        for _ in range(3):
            r = client.post("/login", data={"token": "wrong"}, follow_redirects=False)
            assert r.status_code == 401
        limited = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert limited.status_code == 429, limited.text
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        assert "try again" in limited.json()["detail"]
        assert "set-cookie" not in limited.headers  # even the right token waits


def test_the_right_token_costs_no_try(tmp_path: Path) -> None:
    with _app(tmp_path, login_attempts=2, login_refill_s=60) as client:
        for _ in range(5):
            r = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
            assert r.status_code == 303
        assert client.post("/login", data={"token": "x"}, follow_redirects=False).status_code == 401


def test_a_login_form_over_its_cap_is_413_before_it_is_read(tmp_path: Path) -> None:
    with _app(tmp_path, max_login_bytes=1024) as client:
        r = client.post(
            "/login",
            content=b"token=" + b"a" * 2048,
            follow_redirects=False,
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 413


def test_docs_routes_are_off_by_default(client: TestClient) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect", "/openapi.json"):
        assert client.get(path, headers=AUTH).status_code == 404, path


def test_with_docs_only_the_openapi_document_is_served_and_only_with_the_token(
    tmp_path: Path,
) -> None:
    with _app(tmp_path, docs=True) as client:
        assert client.get("/openapi.json").status_code == 401
        r = client.get("/openapi.json", headers=AUTH)
        assert r.status_code == 200 and "/v1/jobs" in r.json()["paths"]
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert client.get(path, headers=AUTH).status_code == 404, path


def test_a_coordinator_without_a_token_issues_no_job_tokens(tmp_path: Path) -> None:
    with _app(tmp_path, token=None) as client:
        r = client.post("/v1/jobs", json={"name": "open", "world_size": 1})
        assert r.status_code == 201 and r.json()["token"] is None
        assert client.post("/v1/jobs/open/recover", json={}).json()["generation"] == 2
