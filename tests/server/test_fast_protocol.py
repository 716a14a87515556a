"""Heartbeats answered inside ``checkflow serve``'s HTTP parser (``api/fastproto.py``) get the
same replies as the documented routes, one response per request in order on a kept-alive
connection, and anything the fast path refuses gets FastAPI's documented error."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import uvicorn
from checkflow_server.app import create_app
from checkflow_server.settings import Settings

from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.net import free_port, wait_until

pytestmark = pytest.mark.slow


def _request(path: str, body: object, token: str | None = TOKEN, close: bool = False) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    head += [f"Content-Length: {len(data)}"]
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def _responses(sock: socket.socket, n: int) -> list[tuple[int, dict, dict]]:
    """``n`` responses read off ``sock``: (status, lower-cased headers, JSON body)."""
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(out)} of {n} responses"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        size = int(headers["content-length"])
        while len(buf) < size:
            buf += sock.recv(65536)
        body, buf = buf[:size], buf[size:]
        out.append((int(lines[0].split()[1]), headers, json.loads(body)))
    return out


def test_fast_replies_equal_the_routes_and_refusals_are_fastapis_errors_in_order(
    server: ServerProcess,
) -> None:
    with server.http() as http:
        assert http.post("/v1/jobs", json={"name": "f", "world_size": 4}).status_code == 201
        for r in range(4):
            assert http.post(f"/v1/jobs/f/ranks/{r}/register", json={}).status_code == 200
    node = {"ranks": [{"rank": r, "generation": 1, "step": 7} for r in (2, 3)]}
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        # Pipelined on one connection: served ones and refused ones interleaved.
        sock.sendall(
            _request("/v1/jobs/f/ranks/0/heartbeat", {"generation": 1, "step": 5})
            + _request("/v1/jobs/f/ranks/1/heartbeat", {"generation": 1, "step": 5}, token="no")
            + _request("/v1/jobs/f/nodes/n1/heartbeat", node)
            + _request("/v1/jobs/f/ranks/1/heartbeat", b'{"generation": 1, "step": "x"}')
            + _request("/v1/jobs/nope/ranks/0/heartbeat", {"generation": 1, "step": 5})
            + _request("/v1/jobs/f/ranks/1/heartbeat", {"generation": 1, "step": 6})
        )
        got = _responses(sock, 6)
    assert [status for status, _, _ in got] == [200, 401, 200, 422, 404, 200]
    assert got[0][1]["content-type"] == "application/json"
    assert got[0][2] == {**got[5][2]} and got[0][2]["action"] == "continue"
    assert [a["rank"] for a in got[2][2]["ranks"]] == [2, 3]
    assert "token" in got[1][2]["detail"] and "nope" in got[4][2]["detail"]
    with server.http() as http:
        # The same heartbeat through the documented route (httpx sends no pipelining):
        routed = http.post("/v1/jobs/f/ranks/0/heartbeat", json={"generation": 1, "step": 8})
        ranks = http.get("/v1/jobs/f/ranks").json()["ranks"]
    assert routed.json() == got[0][2]
    assert [r["step"] for r in ranks] == [8, 6, 7, 7]


def test_a_heartbeat_asking_to_close_is_answered_and_the_connection_closed(
    server: ServerProcess,
) -> None:
    with server.http() as http:
        assert http.post("/v1/jobs", json={"name": "c", "world_size": 1}).status_code == 201
        assert http.post("/v1/jobs/c/ranks/0/register", json={}).status_code == 200
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            _request("/v1/jobs/c/ranks/0/heartbeat", {"generation": 1, "step": 1}, close=True)
        )
        ((status, headers, body),) = _responses(sock, 1)
        assert (status, body["action"], headers.get("connection")) == (200, "continue", "close")
        assert sock.recv(10) == b""


def test_accepted_heartbeats_never_reach_the_asgi_app_and_refused_ones_do(tmp_path) -> None:
    app = create_app(Settings(db=tmp_path / "c.db", token=TOKEN, sync_storage=False))
    assert app.state.http_protocol is not None
    reached: list[str] = []

    async def counting(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            reached.append(scope["path"])
        await app(scope, receive, send)

    port = free_port()
    config = uvicorn.Config(counting, port=port, http=app.state.http_protocol, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=10, what="coordinator start")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth) as http:
            assert http.post("/v1/jobs", json={"name": "a", "world_size": 1}).status_code == 201
            assert http.post("/v1/jobs/a/ranks/0/register", json={}).status_code == 200
            reached.clear()
            for step in (1, 2, 3):
                hb = {"generation": 1, "step": step}
                assert http.post("/v1/jobs/a/ranks/0/heartbeat", json=hb).status_code == 200
            assert reached == []
            bad = http.post("/v1/jobs/a/ranks/0/heartbeat", json={"generation": 1, "step": -1})
            assert bad.status_code == 422
            assert reached == ["/v1/jobs/a/ranks/0/heartbeat"]
            assert http.get("/v1/jobs/a/ranks").json()["ranks"][0]["step"] == 3
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_job_tokens_heartbeats_take_the_fast_path_and_on_another_job_get_403(
    tmp_path,
) -> None:
    app = create_app(Settings(db=tmp_path / "c.db", token=TOKEN, sync_storage=False))
    reached: list[str] = []

    async def counting(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            reached.append(scope["path"])
        await app(scope, receive, send)

    port = free_port()
    config = uvicorn.Config(counting, port=port, http=app.state.http_protocol, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=10, what="coordinator start")
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
            tokens = {}
            for name in ("a", "b"):
                r = admin.post("/v1/jobs", json={"name": name, "world_size": 1})
                tokens[name] = r.json()["token"]
                assert admin.post(f"/v1/jobs/{name}/ranks/0/register", json={}).is_success
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens['a']}"}) as a:
            reached.clear()
            for step in (1, 2, 3):
                hb = {"generation": 1, "step": step}
                assert a.post("/v1/jobs/a/ranks/0/heartbeat", json=hb).status_code == 200
            assert reached == []
            node = {"ranks": [{"rank": 0, "generation": 1, "step": 4}]}
            assert a.post("/v1/jobs/a/nodes/n/heartbeat", json=node).status_code == 200
            assert reached == []
            other = a.post("/v1/jobs/b/ranks/0/heartbeat", json={"generation": 1, "step": 9})
            assert other.status_code == 403
            assert reached == ["/v1/jobs/b/ranks/0/heartbeat"]
            assert a.get("/v1/jobs/a/ranks").json()["ranks"][0]["step"] == 4
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
            assert admin.get("/v1/jobs/b/ranks").json()["ranks"][0]["step"] == 0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
