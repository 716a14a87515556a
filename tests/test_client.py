"""CoordinatorClient against a real coordinator (uvicorn in a thread of this process)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from checkflow.client import ABORT_EXIT_CODE, CheckpointSchedule, CoordinatorClient
from checkflow.client.progress import ProgressReport
from tests.support.coordinator import TOKEN, ThreadServer
from tests.support.net import free_port, wait_until


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    s = ThreadServer(tmp_path / "c.db", free_port())
    s.start()
    yield s
    s.stop()


def make_client(url: str, rank: int = 0, world: int = 1, **kw: object) -> CoordinatorClient:
    kw = {"heartbeat_interval_s": 0.05, "heartbeat_timeout_s": 1.0, **kw}
    return CoordinatorClient(url, "job", rank, world, token=TOKEN, **kw)  # type: ignore[arg-type]


def test_the_schedule_counts_from_its_anchor() -> None:
    s = CheckpointSchedule(anchor=20, interval=112)
    assert [k for k in range(0, 400) if s.is_checkpoint(k)] == [132, 244, 356]
    assert (s.next_after(95), s.next_after(132)) == (132, 244)


def test_register_heartbeat_and_report_steps(server: ThreadServer) -> None:
    with make_client(server.url) as c:
        reg = c.register()
        assert reg is not None
        assert (reg.generation, reg.restore_step, reg.interval, reg.next_checkpoint_step) == (
            1,
            None,
            10,
            10,
        )
        c.start()
        c.report_progress(7, 0.1, 0.01, 0.2)
        wait_until(lambda: server.get("/v1/jobs/job/ranks")["ranks"][0]["step"] == 7)
        rank = server.get("/v1/jobs/job/ranks")["ranks"][0]
        assert (rank["iteration_s"], rank["stall_s"], rank["persist_s"]) == (0.1, 0.01, 0.2)
        assert c.tuned_interval is None  # the coordinator's warm-up: the rank tunes its own
        assert c.report_persisted(10, 123, 0.5, "step-000000010/rank-00000.json") is True
        c.report_committed(10)
        c.finish()
    assert server.get("/v1/jobs/job/restore-point")["step"] == 10
    assert server.get("/v1/jobs/job/ranks")["ranks"][0]["state"] == "finished"


def test_a_fixed_every_creates_a_job_shown_as_fixed(server: ThreadServer) -> None:
    with make_client(server.url, every=20) as c:
        reg = c.register()
        assert reg is not None and (reg.interval, reg.schedule.mode) == (20, "fixed")
        assert c.tuned_interval is None  # never the coordinator's: the rank's own 20
    job = server.get("/v1/jobs/job")
    assert (job["interval"], job["schedule"]["mode"], job["next_checkpoint_step"]) == (
        20,
        "fixed",
        20,
    )


def test_a_fixed_every_the_coordinator_would_refuse_is_said_at_once() -> None:
    with pytest.raises(ValueError, match="(?s)job settings the coordinator would refuse.*every"):
        make_client("http://127.0.0.1:9", every=0)


def test_finish_sends_the_last_progress_a_short_run_never_beat(server: ThreadServer) -> None:
    # A run (or the last round after a restart) that ends before its first heartbeat: the
    # coordinator still learns its last step and step time (an XLA job's 3-step round did).
    with make_client(server.url, heartbeat_interval_s=3600.0) as c:
        assert c.register() is not None
        c.start()
        c.report_progress(4, 0.25, 0.02, 0.3)
        c.finish()
    rank = server.get("/v1/jobs/job/ranks")["ranks"][0]
    assert (rank["state"], rank["step"]) == ("finished", 4)
    assert (rank["iteration_s"], rank["stall_s"], rank["persist_s"]) == (0.25, 0.02, 0.3)


def test_abort_calls_on_abort_with_the_reason(server: ThreadServer) -> None:
    reasons: list[str] = []
    with (
        make_client(server.url, 0, 2, on_abort=reasons.append) as c0,
        make_client(server.url, 1, 2) as c1,
    ):
        assert c0.register() and c1.register()
        c0.start()
        httpx.post(
            f"{server.url}/v1/jobs/job/recover",
            json={},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ).raise_for_status()
        wait_until(lambda: reasons)
    assert "moved to generation 2" in reasons[0]
    assert CoordinatorClient.ABORT_EXIT_CODE == ABORT_EXIT_CODE == 75


def test_training_goes_on_while_the_coordinator_is_down_and_catches_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    server = ThreadServer(tmp_path / "c.db", port)
    caplog.set_level(logging.WARNING, logger="checkflow.client")
    with make_client(server.url) as c:
        t = time.monotonic()
        assert c.register() is None  # nobody listening: no wait beyond one refused connect
        assert time.monotonic() - t < 1.0
        assert c.report_persisted(10, 1, 0.1, "m") is None
        c.start()
        c.report_progress(3)
        time.sleep(0.3)
        unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(unreachable) == 1  # logged once, not per retry
        server.start()
        try:
            wait_until(lambda: c.generation == 1, timeout=10)  # registered on its own
            c.report_progress(5)
            wait_until(lambda: server.get("/v1/jobs/job/ranks")["ranks"][0]["step"] == 5)
            assert c.interval == 10
            assert any("reachable again" in r.getMessage() for r in caplog.records)
        finally:
            server.stop()


def test_heartbeat_retries_leave_the_training_random_sequence_alone(tmp_path: Path) -> None:
    # The backoff while the coordinator is down draws jitter on the heartbeat thread. The
    # global `random` state belongs to training (checkpoints save and restore it): a draw
    # there would make a run differ from an uninterrupted one by how many retries happened.
    import random

    random.seed(1234)
    before = random.getstate()
    with make_client(f"http://127.0.0.1:{free_port()}") as c:
        c.start()
        time.sleep(0.6)  # backoff rounds (0.1, 0.2, 0.4 s) against a port nobody listens on
        assert c.generation is None
    assert random.getstate() == before


def test_measurements_the_coordinator_would_refuse_are_left_out_of_heartbeats(
    server: ThreadServer,
) -> None:
    # An infinite step time would be refused (422); a refused heartbeat is a missed one.
    with make_client(server.url) as c:
        assert c.register() is not None
        c.start()
        c.report_progress(5, float("inf"), float("nan"), -1.0)
        wait_until(lambda: server.get("/v1/jobs/job/ranks")["ranks"][0]["step"] == 5)
        rank = server.get("/v1/jobs/job/ranks")["ranks"][0]
        assert (rank["state"], rank["iteration_s"], rank["stall_s"], rank["persist_s"]) == (
            "alive",
            None,
            None,
            None,
        )


def test_settings_the_coordinator_would_refuse_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="name"):
        CoordinatorClient("http://127.0.0.1:9", "a/b", 0, 1)
    with pytest.raises(ValueError, match="rank 2 is not in a job of world size 2"):
        CoordinatorClient("http://127.0.0.1:9", "job", 2, 2)


def test_a_reply_that_is_not_the_protocol_counts_as_unavailable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Garbage(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = b'{"unexpected": true}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    caplog.set_level(logging.WARNING, logger="checkflow.client")
    try:
        with make_client(f"http://127.0.0.1:{httpd.server_address[1]}") as c:
            assert c.register() is None  # training goes on, as with no coordinator
            assert c.schedule is None and c.tuned_interval is None
    finally:
        httpd.shutdown()
        thread.join(10)
    assert any("unreadable reply to POST /v1/jobs" in r.getMessage() for r in caplog.records)


def test_pauses_nest_and_a_pause_between_heartbeats_is_reported_once() -> None:
    report = ProgressReport()
    report.update(4, 0.5)
    assert report.heartbeat(1).paused is False
    with report.paused():
        with report.paused():
            pass
        assert report.heartbeat(1).paused is True  # the outer pause is still on
    assert report.heartbeat(1).paused is True  # it ended after the last heartbeat: once
    assert report.heartbeat(1).paused is False
    beat = report.heartbeat(3)
    assert (beat.generation, beat.step, beat.iteration_s) == (3, 4, 0.5)


def test_a_paused_client_is_not_hung_and_a_still_one_is(server: ThreadServer) -> None:
    reasons: list[str] = []
    with make_client(server.url, hang_timeout_s=0.4, on_abort=reasons.append) as c:
        assert c.register() is not None
        assert server.get("/v1/jobs/job")["hang_timeout_s"] == 0.4
        c.start()
        c.report_progress(1)
        wait_until(lambda: server.get("/v1/jobs/job/ranks")["ranks"][0]["step"] == 1)
        with c.paused():
            time.sleep(1.5)  # more than three hang timeouts at a still step
        assert not reasons
        start = time.monotonic()
        wait_until(lambda: reasons, timeout=5)  # no pause now: the still step is a hang
        assert time.monotonic() - start < 2.0
    [failed] = [
        e for e in server.get("/v1/jobs/job/events")["events"] if e["kind"] == "rank_failed"
    ]
    assert failed["detail"]["kind"] == "hung"


def test_a_failed_rank_asks_at_once_whether_its_generation_ended(server: ThreadServer) -> None:
    reasons: list[str] = []
    with make_client(server.url, on_abort=reasons.append) as c:
        assert c.register() is not None  # no heartbeat thread: only the explicit question
        c.exit_if_aborted()
        assert not reasons  # generation 1 goes on: a real error, left to fail as a crash
        httpx.post(
            f"{server.url}/v1/jobs/job/recover",
            json={},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ).raise_for_status()
        c.exit_if_aborted()
        assert len(reasons) == 1 and "moved to generation 2" in reasons[0]
