"""The coordinator fetches a job's ``storage_uri`` only when the operator allowed its
scheme (and host): ``checkflow serve --storage-allow``; the default allows none (SSRF)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkflow_server.settings import Settings
from checkflow_server.storage_sync import storage_allowed

from checkflow.cli import main
from checkflow.manifest import MANIFEST, step_dir
from checkflow.protocol import paths
from tests.support.coordinator import served
from tests.support.net import wait_until


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers 404 to everything and records each request's path."""

    hits: list[str]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        self.send_error(404)

    do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on 127.0.0.1 standing for an internal address; (base URL, hits)."""
    hits: list[str] = []
    handler = type("Handler", (Recorder,), {"hits": hits})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", hits
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    ("uri", "allow", "allowed"),
    [
        ("http://169.254.169.254/latest/meta-data", [], False),
        ("/data/ckpt", [], False),
        ("s3://bucket/run", ["s3"], True),
        ("s3://bucket/run", ["s3://bucket"], True),
        ("s3://other/run", ["s3://bucket"], False),
        ("S3://BUCKET/run", ["s3://bucket"], True),
        ("http://169.254.169.254/x", ["s3", "file"], False),
        ("http://127.0.0.1:9000/x", ["http://127.0.0.1"], False),
        ("http://127.0.0.1:9000/x", ["http://127.0.0.1:9000"], True),
        ("s3://bucket@169.254.169.254/x", ["s3://169.254.169.254", "s3://bucket"], False),
        ("simplecache::http://169.254.169.254/x", ["simplecache", "http"], False),
        ("/data/ckpt", ["file"], True),
        ("file:///data/ckpt", ["file"], True),
        ("C:/data/ckpt", ["file"], True),
        ("http://[::1]/x", ["http"], False),
        ("http://host:99999999/x", ["http"], False),
    ],
)
def test_storage_allowed(uri: str, allow: list[str], allowed: bool) -> None:
    assert storage_allowed(uri, allow) is allowed


@pytest.mark.parametrize("rule", ["", "s3://", "http://host/path", "s3://u@host", "a b"])
def test_a_bad_rule_is_refused(rule: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SCHEME or SCHEME://HOST"):
        Settings(db=tmp_path / "c.db", storage_allow=[rule])


def test_checkflow_serve_refuses_a_bad_rule_with_one_line(tmp_path: Path, capsys) -> None:
    code = main(["serve", "--db", str(tmp_path / "c.db"), "--storage-allow", "http://a/b"])
    err = capsys.readouterr().err
    assert code == 2 and "storage_allow 'http://a/b'" in err


def create_and_register(url: str, name: str, uri: str) -> None:
    with httpx.Client(base_url=url, timeout=5) as c:
        body = {"name": name, "world_size": 1, "storage_uri": uri}
        assert c.post(paths.path(paths.JOBS), json=body).status_code in (200, 201)
        r = c.post(paths.path(paths.REGISTER, job=name, rank=0), json={})
        assert r.status_code == 200, r.text


def test_by_default_the_coordinator_fetches_no_storage_uri(
    recorder: tuple[str, list[str]], tmp_path: Path
) -> None:
    base, hits = recorder
    with served(tmp_path / "c.db", token=None) as server:
        create_and_register(server.url, "ssrf", f"{base}/latest/meta-data")
        create_and_register(server.url, "metadata", "http://169.254.169.254/latest/meta-data")
        server.stop()
        server.start()  # a restart lists every job's storage, when allowed
        create_and_register(server.url, "ssrf", f"{base}/latest/meta-data")
        time.sleep(0.5)
    assert hits == []


def test_an_allowed_host_is_listed_and_another_is_not(
    recorder: tuple[str, list[str]], tmp_path: Path
) -> None:
    """The control: the recorder does see the coordinator's listing when it is allowed."""
    base, hits = recorder
    with served(tmp_path / "c.db", token=None, options=("--storage-allow", base)) as server:
        create_and_register(server.url, "other", "http://localhost:1/ckpt")
        create_and_register(server.url, "allowed", f"{base}/ckpt")
        wait_until(lambda: hits, timeout=10, what="the allowed listing")
    assert all(h.startswith("/ckpt") for h in hits), hits


def test_allowed_local_storage_teaches_the_coordinator_its_commits(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / step_dir(7)).mkdir(parents=True)
    (root / step_dir(7) / MANIFEST).write_text("{}")
    for options, expected in (((), None), (("--storage-allow", "file"), 7)):
        with served(tmp_path / f"c{len(options)}.db", token=None, options=options) as server:
            create_and_register(server.url, "local", str(root))
            reply = httpx.get(server.url + paths.path(paths.RESTORE_POINT, job="local")).json()
        assert reply["step"] == expected, options
