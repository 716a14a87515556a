"""The dashboard's sign-in and session cookie, over HTTP against the app (no browser):
what the cookie may do, when it stops working, and what the page and its files send."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkflow_server.api import session
from checkflow_server.app import create_app
from checkflow_server.settings import Settings
from fastapi.testclient import TestClient

from tests.support.coordinator import TOKEN


def _client(tmp_path: Path, token: str | None = TOKEN) -> TestClient:
    settings = Settings(db=tmp_path / "coordinator.db", token=token, sync_storage=False)
    return TestClient(create_app(settings), base_url="http://127.0.0.1")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with _client(tmp_path) as c:
        yield c


def _sign_in(client: TestClient) -> str:
    r = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    return r.cookies[session.COOKIE]


def test_signed_in_cookie_reads_the_api_but_cannot_change_it(client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/v1/jobs", json={"name": "a", "world_size": 1}, headers=auth).is_success
    assert client.get("/v1/jobs").status_code == 401
    _sign_in(client)
    assert [j["name"] for j in client.get("/v1/jobs").json()["jobs"]] == ["a"]
    assert client.get("/v1/jobs/a/events").status_code == 200
    # Changes need the token itself: a cookie (sent by the browser on its own) is not enough.
    assert client.post("/v1/jobs", json={"name": "b", "world_size": 1}).status_code == 401
    assert client.post("/v1/jobs/a/recover", json={}).status_code == 401
    assert client.post("/v1/jobs/a/ranks/0/register", json={}).status_code == 401


def test_login_cookie_is_httponly_strict_and_is_not_the_token(client: TestClient) -> None:
    r = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    header = r.headers["set-cookie"]
    assert "HttpOnly" in header and "SameSite=strict" in header
    assert f"Max-Age={session.MAX_AGE_S}" in header
    assert TOKEN not in header


def test_wrong_or_missing_token_gets_the_form_with_401_and_no_cookie(client: TestClient) -> None:
    for form in ({"token": "wrong"}, {"token": ""}, {}):
        r = client.post("/login", data=form, follow_redirects=False)
        assert r.status_code == 401
        assert "Wrong token" in r.text and 'action="/login"' in r.text
        assert session.COOKIE not in r.cookies
    page = client.get("/")
    assert page.status_code == 401 and 'method="post"' in page.text


def test_expired_forged_or_old_token_cookie_is_refused(tmp_path: Path) -> None:
    now = time.time()
    assert session.valid(TOKEN, session.issue(TOKEN, now), now)
    assert not session.valid(TOKEN, session.issue(TOKEN, now - session.MAX_AGE_S - 1), now)
    assert not session.valid(TOKEN, session.issue("another-token", now), now)
    assert not session.valid(TOKEN, f"{int(now)}.{'0' * 64}", now)
    assert not session.valid(TOKEN, "", now) and not session.valid(TOKEN, None, now)
    assert not session.valid(TOKEN, f"-1.{session.issue(TOKEN, now).split('.')[1]}", now)
    with _client(tmp_path) as c:
        c.cookies.set(session.COOKIE, session.issue(TOKEN, now - session.MAX_AGE_S - 60))
        assert c.get("/v1/jobs").status_code == 401
        assert c.get("/").status_code == 401


def test_logout_clears_the_cookie(client: TestClient) -> None:
    _sign_in(client)
    assert client.get("/").status_code == 200
    r = client.post("/logout", follow_redirects=False)
    assert r.status_code == 303 and f'{session.COOKIE}=""' in r.headers["set-cookie"]
    client.cookies.clear()
    assert client.get("/").status_code == 401


def test_without_a_token_configured_the_page_opens_directly(tmp_path: Path) -> None:
    with _client(tmp_path, token=None) as c:
        assert c.get("/").status_code == 200
        assert c.post("/login", data={}, follow_redirects=False).status_code == 303


def test_page_allows_scripts_and_styles_only_from_the_coordinator(client: TestClient) -> None:
    _sign_in(client)
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert page.headers["cache-control"] == "no-store"
    assert '<script src="/dashboard/dashboard.js"' in page.text
    assert "http://" not in page.text and "https://" not in page.text


def test_dashboard_files_are_served_from_the_package_and_nothing_else(client: TestClient) -> None:
    js = client.get("/dashboard/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "function refresh" in js.text
    assert client.get("/dashboard/dashboard.css").headers["content-type"].startswith("text/css")
    for name in ("login.html", "..%2Froutes.py", "../assets.py", "nope.js"):
        assert client.get(f"/dashboard/{name}").status_code == 404
