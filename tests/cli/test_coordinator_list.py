"""``checkflow status`` and ``checkflow restore --coordinator`` (and ``run``'s check of its
settings) with a list of coordinator URLs (issue 33), against a real ``checkflow serve``:
a dead first URL is skipped, a 307 is followed with the POST's body, a redirect off the
list is refused (exit 3) without the far host seeing anything, a bad list exits 2 in one
line, and a list where nothing answers exits 3 naming each URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from checkflow.client import CoordinatorClient
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.net import free_port
from tests.support.redirect import http_server


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("CHECKFLOW_")}
    child.update({"CHECKFLOW_TOKEN": TOKEN, **env})
    return subprocess.run(
        [sys.executable, "-m", "checkflow.cli", *args],
        capture_output=True, text=True, timeout=180, env=child,
    )  # fmt: skip


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def commit_steps(server: ServerProcess, job: str, *steps: int) -> None:
    """A real rank client registers ``job`` and commits ``steps`` at ``server``; its silence
    afterwards is no failure for as long as a test runs."""
    with CoordinatorClient(server.url, job, 0, 1, token=TOKEN, heartbeat_timeout_s=3600) as c:
        assert c.register() is not None
        for step in steps:
            assert c.report_persisted(step, 1, 0.1, f"step-{step:09d}/rank-00000.json") is True
            c.report_committed(step)


def test_status_and_restore_skip_a_dead_first_url(tmp_path):
    with served(tmp_path / "c.db") as live:
        commit_steps(live, "listed", 10, 20)
        urls = f"{dead_url()},{live.url}"
        res = run_cli("status", urls)
        assert res.returncode == 0, res.stderr
        assert "listed" in res.stdout
        res = run_cli("status", "listed", CHECKFLOW_URL=urls)
        assert res.returncode == 0 and "listed" in res.stdout, res.stderr
        res = run_cli("restore", "--coordinator", urls, "--job", "listed", "--step", "10")
        assert res.returncode == 0, res.stderr
        assert "job listed rolled back to step 10: generation 2" in res.stdout
        assert live.job("listed").restore_step == 10


def test_restore_follows_a_307_with_its_body_to_a_listed_replica(tmp_path):
    with (
        served(tmp_path / "c.db") as owner,
        http_server(307, b"", redirect_to=owner.url) as (replica, seen),
    ):
        commit_steps(owner, "moved", 10, 20)
        urls = f"{replica},{owner.url}"
        res = run_cli("restore", "--coordinator", urls, "--job", "moved", "--step", "10")
        assert res.returncode == 0, res.stderr
        # Step 10, not the newest (20): the body {"step": 10} came along with the POST.
        assert "rolled back to step 10" in res.stdout and owner.job("moved").restore_step == 10
        [(method, _, headers, body)] = seen.requests
        assert method == "POST" and json.loads(body) == {"step": 10}
        assert headers["authorization"] == f"Bearer {TOKEN}"


def test_a_redirect_off_the_list_exits_3_and_the_far_host_sees_nothing():
    with (
        http_server(200, b'{"jobs": []}') as (far, far_seen),
        http_server(307, b"", redirect_to=far) as (hostile, _),
    ):
        for argv in (["status", hostile], ["restore", "--coordinator", hostile, "--job", "j"]):
            res = run_cli(*argv)
            assert res.returncode == 3, (argv, res.stderr)
            assert f"redirected to {far}, which is not one of the coordinator URLs" in res.stderr
            assert len(res.stderr.splitlines()) == 1
        assert far_seen.requests == []


def test_nothing_answering_exits_3_naming_each_url():
    one, two = dead_url(), dead_url()
    res = run_cli("status", f"{one},{two}")
    assert res.returncode == 3
    assert f"cannot reach the coordinator at {one},{two} ({one}: ConnectError" in res.stderr
    assert f"; {two}: ConnectError" in res.stderr and len(res.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("urls", "says"),
    [
        ("http://127.0.0.1:1,,http://127.0.0.1:2", "coordinator URL 2 is empty"),
        ("http://127.0.0.1:1, ftp://127.0.0.1:2", "coordinator URL 2 ('ftp://127.0.0.1:2') is not"),
        ("http://127.0.0.1:1,http://127.0.0.1:1/", "is listed twice"),
        ("http://127.0.0.1:1,http://a b:2", "whitespace or control characters"),
    ],
)
def test_a_bad_list_exits_2_in_one_line_for_every_command(urls: str, says: str):
    for argv in (
        ["status", urls],
        ["restore", "--coordinator", urls, "--job", "j"],
        ["run", "--coordinator", urls, "--job", "j", "--nproc-per-node=1", "train.py"],
    ):
        res = run_cli(*argv)
        assert res.returncode == 2, (argv, res.stderr)
        assert says in res.stderr and len(res.stderr.splitlines()) == 1, (argv, res.stderr)
    res = run_cli("status", CHECKFLOW_URL=urls)
    assert res.returncode == 2 and says in res.stderr, res.stderr
