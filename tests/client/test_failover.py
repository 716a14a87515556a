"""Clients with a list of coordinator URLs (issue 33), against real ``checkflow serve``
processes on 127.0.0.1: a dead first URL is skipped, a coordinator killed mid-run is left
for the next one while training goes on, a hanging one costs one timeout and not one per
URL, a 307 is followed (method, body and token kept) to a listed replica and refused to
any other host, which never sees the token.

The coordinators here do not share state (that is the PostgreSQL replicas' part): the
tests assert only where the client's requests go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from checkflow.client import CoordinatorClient, CoordinatorUnavailable
from checkflow.client.transport import Channel
from checkflow.protocol import JobList, paths
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.net import free_port, wait_until
from tests.support.redirect import http_server, silent_port

STEADY = Path(__file__).with_name("_steady_train.py")


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connections are refused


def client(urls: str, **kw: object) -> CoordinatorClient:
    kw = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 10.0, **kw}
    return CoordinatorClient(urls, "job", 0, 1, token=TOKEN, **kw)  # type: ignore[arg-type]


def rank_step(server: ServerProcess, job: str = "job") -> int | None:
    try:
        ranks = server.ranks(job)
    except httpx.HTTPError:
        return None
    return ranks[0].step if ranks else None


# -- the rank client -----------------------------------------------------------------------
def test_a_dead_first_url_is_skipped_and_the_client_sticks_to_the_live_one(tmp_path):
    with served(tmp_path / "c.db") as live, client(f"{dead_url()},{live.url}") as c:
        reg = c.register()
        assert reg is not None and reg.generation == 1
        assert c._beats.failover.current == live.url  # shared by both connections
        c.start()
        c.report_progress(7, 0.1)
        wait_until(lambda: rank_step(live) == 7, timeout=30, what="a heartbeat at the live one")


def test_a_coordinator_killed_mid_run_leaves_training_on_the_next_one(tmp_path):
    """A real ``Checkpointer`` trains against ``A,B``; A is SIGKILLed mid-run. The ranks'
    requests go to B from then on (B, a separate database here, learns the job from the
    re-registration a 404 starts), checkpoints are reported there, and no training step
    waited for the failover."""
    a, b = ServerProcess(tmp_path / "a.db"), ServerProcess(tmp_path / "b.db")
    a.start()
    b.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKFLOW_")}
    cmd = [sys.executable, str(STEADY), str(tmp_path / "ckpt"), f"{a.url},{b.url}", "job"]
    proc = subprocess.Popen(
        [*cmd, "120", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "CHECKFLOW_TOKEN": TOKEN},
    )
    try:
        wait_until(lambda: (rank_step(a) or 0) >= 10, timeout=120, what="training at A")
        a.kill()
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        [rank] = b.ranks("job")
        assert rank.state == "finished" and (rank.step or 0) > 100  # steps after the kill
        committed = [c.step for c in b.checkpoints("job") if c.status == "committed"]
        assert committed and max(committed) == 120, committed
        longest = float(out.split("longest step ")[1].split()[0])
        assert longest < 2.0, f"a training step waited {longest} s (the request timeout: 2 s)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        a.stop()
        b.stop()


def test_a_hanging_coordinator_costs_one_timeout_not_one_per_url(tmp_path):
    """Four URLs that accept and never answer, then a live one: a call on the training
    thread (register) blocks about one timeout (1 s), never four; the heartbeat thread then
    walks the list, one hanging URL per try, to the live one."""
    with (
        silent_port() as h1,
        silent_port() as h2,
        silent_port() as h3,
        silent_port() as h4,
        served(tmp_path / "c.db") as live,
        client(",".join([h1, h2, h3, h4, live.url]), timeout_s=1.0) as c,
    ):
        began = time.monotonic()
        assert c.register() is None
        took = time.monotonic() - began
        assert took < 3.0, f"register blocked {took:.1f} s over the list (one timeout: 1 s)"
        c.start()
        c.report_progress(3)
        wait_until(lambda: rank_step(live) == 3, timeout=90, what="the live URL, fifth")


# -- redirects -----------------------------------------------------------------------------
def test_a_307_to_a_listed_replica_keeps_method_body_and_token_and_is_stuck_to(tmp_path):
    with (
        served(tmp_path / "c.db") as owner,
        http_server(307, b"", redirect_to=owner.url) as (replica, seen),
        client(f"{replica},{owner.url}", every=20) as c,
    ):
        reg = c.register()
        assert reg is not None
        # The POST's body reached the owner (the job's fixed interval is in it), with the
        # token (the owner answers 401 without one).
        job = owner.job("job")
        assert (job.world_size, job.interval, job.schedule.mode) == (1, 20, "fixed")
        # Once the owner answered, the client went there directly: one request at the replica.
        [(method, path, headers, body)] = seen.requests
        assert (method, path) == ("POST", paths.path(paths.JOBS))
        assert json.loads(body)["every"] == 20 and headers["authorization"] == f"Bearer {TOKEN}"


def test_a_307_off_the_list_is_not_followed_and_the_token_stays(tmp_path):
    with (
        http_server(200, b'{"jobs": []}') as (far, far_seen),
        http_server(307, b"", redirect_to=far) as (hostile, _),
        served(tmp_path / "c.db") as live,
    ):
        with Channel(hostile, TOKEN, 2.0) as alone, pytest.raises(CoordinatorUnavailable) as e:
            alone.call("GET", paths.path(paths.JOBS), None, JobList)
        assert f"{hostile}: RedirectRefused: redirected to {far}" in str(e.value)
        assert "not one of the coordinator URLs given" in str(e.value)
        # With a live replica after it in the list, the call goes on there.
        with Channel(f"{hostile},{live.url}", TOKEN, 2.0) as both:
            assert both.call("GET", paths.path(paths.JOBS), None, JobList).jobs == []
        assert far_seen.requests == []  # never asked: no token, no body left the list


def test_a_5xx_moves_on_to_the_next_url_and_all_failing_names_each(tmp_path):
    with (
        http_server(503, b'{"detail": "database down"}') as (sick, _),
        served(tmp_path / "c.db") as live,
    ):
        with Channel(f"{sick},{live.url}", TOKEN, 2.0) as ch:
            assert ch.call("GET", paths.path(paths.JOBS), None, JobList).jobs == []
            assert ch.failover.current == live.url
        dead = dead_url()
        with (
            Channel(f"{sick},{dead}", TOKEN, 2.0) as ch,
            pytest.raises(CoordinatorUnavailable) as e,
        ):
            ch.call("GET", paths.path(paths.JOBS), None, JobList)
        assert f"{sick}: HTTP 503" in str(e.value) and f"{dead}: ConnectError" in str(e.value)


def test_a_redirect_to_an_unusable_url_counts_as_that_url_failing(tmp_path):
    """A listed replica whose Location is no URL (a control character, 70 kB): no
    exception escapes to the caller; the next URL answers, and alone it is unavailable."""
    with served(tmp_path / "c.db") as live:
        for junk in ("/\x7f", "/" + "a" * 70_000):
            with http_server(307, b"", redirect_to=live.url + junk) as (odd, _):
                with Channel(f"{odd},{live.url}", TOKEN, 2.0) as ch:
                    assert ch.call("GET", paths.path(paths.JOBS), None, JobList).jobs == []
                with Channel(odd, TOKEN, 2.0) as ch, pytest.raises(CoordinatorUnavailable) as e:
                    ch.call("GET", paths.path(paths.JOBS), None, JobList)
                assert str(e.value).startswith(f"{odd}: ") and "Invalid" in str(e.value)
