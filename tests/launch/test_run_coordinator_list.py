"""``checkflow run --coordinator DEAD,LIVE`` (issue 33): the agent's job-token trade, its
watch and its crash report, and the workers' own clients, all go past the dead first URL
to the live one; the workers get the whole list in ``CHECKFLOW_COORDINATOR``."""

from __future__ import annotations

from checkflow.protocol import EventList, paths
from tests.launch._nodes import create_job
from tests.launch.test_run import lines, run_job
from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.net import free_port


def test_checkflow_run_with_a_dead_first_url_reports_to_the_live_one(tmp_path):
    server = ServerProcess(tmp_path / "coordinator.db")
    server.start()
    urls = f"http://127.0.0.1:{free_port()},{server.url}"
    try:
        create_job(server.url, TOKEN, "listed", 2, heartbeat_timeout_s=60.0)
        out = run_job(tmp_path, "--coordinator", urls, "--job", "listed", "--token", TOKEN)
        with server.http() as http:
            reply = http.get(paths.path(paths.EVENTS, job="listed"))
        ranks = server.ranks("listed")
    finally:
        server.stop()
    assert {(url, job) for _, _, url, job in lines(out, "env")} == {(urls, "listed")}
    events = EventList.model_validate_json(reply.content).events
    failed = [e for e in events if e.kind == "rank_failed"]
    assert [(e.rank, e.detail["kind"]) for e in failed] == [(1, "crash")]  # from the agent
    assert sorted((r.rank, r.state) for r in ranks) == [(0, "finished"), (1, "finished")]
    launcher = (tmp_path / "launcher.out").read_text()
    assert "could not get a job token" not in launcher, launcher[-2000:]
