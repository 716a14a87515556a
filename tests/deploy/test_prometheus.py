"""``deploy/prometheus`` against Debian's Prometheus 2.42 (package ``prometheus``, which
brings ``promtool`` too; ``.ci/run`` installs it): the rules pass ``promtool check rules``
and their unit tests (``checkflow-rules.test.yml``), a real coordinator's scrape passes
``promtool check metrics``, and a real Prometheus scraping it with the token stores
``checkflow_job`` (not ``exported_job``) and holds "ranks lost" for a crashed job only.

Without the package these tests skip on a developer's machine and fail in CI (``CI`` set).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from checkflow.client.rank import ABORT_EXIT_CODE
from tests.support.coordinator import TOKEN, ServerProcess, start_rank
from tests.support.net import free_port

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "checkflow-rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "checkflow-dashboard.json"
RULE_TESTS = Path(__file__).with_name("checkflow-rules.test.yml")
SCRAPE_JOB = "checkflow-coordinator"


def debian_tool(name: str) -> str:
    """``/usr/bin/<name>`` of Debian's ``prometheus`` package; fails in CI when missing."""
    found = shutil.which(name)
    if found:
        return found
    why = f"{name} is missing: apt-get install prometheus (Debian's package; .ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def run(*cmd: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_the_alert_rules_pass_promtool_check_rules() -> None:
    result = run(debian_tool("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


def test_the_alert_rules_fire_for_the_right_jobs_in_promtool_unit_tests() -> None:
    """Hung, old checkpoint, lost ranks, no commits: each fires for its job only, never for
    a finished one (``checkflow-rules.test.yml`` says which job is which)."""
    result = run(debian_tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_names_only_metrics_a_real_coordinator_exposes(scrape: str) -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [
        "CheckflowJobHung",
        "CheckflowCheckpointTooOld",
        "CheckflowRanksLost",
        "CheckflowPersistFailing",
        "CheckflowRetentionFailing",
    ]
    used = {m for r in rules for m in re.findall(r"\b(checkflow_[a-z_]+)", r["expr"])}
    exposed = set(re.findall(r"^# TYPE (checkflow_[a-z_]+) ", scrape, re.MULTILINE))
    assert used <= exposed, f"rules name metrics the coordinator lacks: {used - exposed}"
    assert "checkflow_job" not in exposed  # the label, never a metric


# --- a real coordinator with a finished job and a crashed one ---------------------------


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``checkflow serve`` (uvicorn) with job ``done`` (2 ranks trained to step 30,
    committing every 10 steps, and finished) and job ``crashed`` (rank 1 died at step 5,
    rank 0 was told to abort): both have no rank alive."""
    server = ServerProcess(tmp_path_factory.mktemp("coordinator") / "c.db")
    server.start()
    try:
        done = [start_rank(server.url, "done", r, 2, "--steps", "30", "--step-time", "0.01")
                for r in range(2)]  # fmt: skip
        crash = ["--steps", "2000", "--step-time", "0.02", "--heartbeat-timeout", "1"]
        crashed = [start_rank(server.url, "crashed", r, 2, *crash, *(["--crash-at", "5"] * r))
                   for r in range(2)]  # fmt: skip
        codes = [p.wait(timeout=60) for p in done + crashed]
        assert codes == [0, 0, ABORT_EXIT_CODE, 1], [p.stderr.read() for p in done + crashed]
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def scrape(coordinator: ServerProcess) -> str:
    with coordinator.http() as c:
        reply = c.get("/metrics")
    assert reply.status_code == 200
    return reply.text


def test_a_real_scrape_passes_promtool_check_metrics(scrape: str) -> None:
    result = run(debian_tool("promtool"), "check", "metrics", stdin=scrape)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_scrape_tells_a_finished_job_from_a_crashed_one_and_dates_its_checkpoint(
    coordinator: ServerProcess, scrape: str
) -> None:
    samples = dict(line.rsplit(" ", 1) for line in scrape.splitlines() if line[:1] != "#")
    for name, done, crashed in (
        ("checkflow_world_size", "2", "2"),
        ("checkflow_ranks_alive", "0", "0"),
        ("checkflow_ranks_finished", "2", "0"),
        ("checkflow_job_step", "30", "0"),
    ):
        assert samples[f'{name}{{checkflow_job="done"}}'] == done, name
        assert samples[f'{name}{{checkflow_job="crashed"}}'] == crashed, name
    assert samples['checkflow_latest_checkpoint_step{checkflow_job="done"}'] == "30"
    newest = coordinator.checkpoints("done")[0]
    assert newest.step == 30 and newest.committed_at is not None
    stamp = float(samples['checkflow_latest_checkpoint_timestamp_seconds{checkflow_job="done"}'])
    assert stamp == pytest.approx(newest.committed_at, abs=1e-3)
    assert 0 < time.time() - stamp < 120
    assert not any("job=" in key and "checkflow_job=" not in key for key in samples)


@pytest.mark.parametrize("token", [None, TOKEN])
def test_head_metrics_answers_200_with_no_body_like_get(
    coordinator: ServerProcess, token: str | None
) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    host, port = coordinator.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("HEAD", "/metrics", headers=headers)
        head = conn.getresponse()
        assert (head.status, head.read()) == (200, b"")
        conn.request("GET", "/metrics", headers=headers)
        get = conn.getresponse()
        body = get.read()
    finally:
        conn.close()
    assert get.status == 200 and body.startswith(b"# HELP checkflow_jobs ")
    assert head.getheader("content-type") == get.getheader("content-type")
    assert head.getheader("content-type", "").startswith("text/plain; version=0.0.4")


# --- a real Prometheus scraping it --------------------------------------------------------


def test_a_real_prometheus_stores_checkflow_job_and_holds_ranks_lost_for_the_crashed_job_only(
    coordinator: ServerProcess, tmp_path: Path
) -> None:
    prometheus = debian_tool("prometheus")
    with RunningPrometheus(prometheus, coordinator, tmp_path) as api:
        alive = wait_for(api, "query", {"query": "checkflow_ranks_alive"}, lambda r: len(r) == 2)
        assert {tuple(sorted(s["metric"].items())) for s in alive} == {
            (
                ("__name__", "checkflow_ranks_alive"),
                ("checkflow_job", job),
                ("instance", coordinator.url.removeprefix("http://")),
                ("job", SCRAPE_JOB),
            )
            for job in ("done", "crashed")
        }
        assert api("query", {"query": '{exported_job!=""}'}) == []
        assert api("label/checkflow_job/values", {}) == ["crashed", "done"]
        [target] = api("targets", {})["activeTargets"]
        assert (target["health"], target["lastError"]) == ("up", "")

        # The rule group evaluates every 0.5 s; with `for: 5m`, a true expression is held
        # as pending. The crashed job's is; the finished job's never becomes true.
        alerts = wait_for(api, "alerts", {}, lambda r: r["alerts"])["alerts"]
        lost = [
            (a["labels"]["alertname"], a["labels"]["checkflow_job"], a["state"]) for a in alerts
        ]
        assert lost == [("CheckflowRanksLost", "crashed", "pending")]
        assert alerts[0]["value"] in ("2e+00", "2")
        for panel in json.loads(DASHBOARD.read_text())["panels"]:
            for target in panel["targets"]:  # each is PromQL this Prometheus evaluates
                series = api("query", {"query": target["expr"]})
                if "{{checkflow_job}}" in target["legendFormat"]:
                    assert {s["metric"]["checkflow_job"] for s in series} <= {"done", "crashed"}
                    assert series, f"{panel['title']}: no series of {target['expr']}"
        [group] = api("rules", {"type": "alert"})["groups"]
        assert {r["name"]: r["health"] for r in group["rules"]} == {
            "CheckflowJobHung": "ok",
            "CheckflowCheckpointTooOld": "ok",
            "CheckflowRanksLost": "ok",
            "CheckflowPersistFailing": "ok",
            "CheckflowRetentionFailing": "ok",
        }


class RunningPrometheus:
    """``prometheus`` on a free 127.0.0.1 port scraping ``coordinator`` every 0.5 s with its
    token from a file (``authorization: credentials_file``), the shipped rules loaded; the
    ``with`` value calls its HTTP API (``/api/v1/<path>``) and returns ``data``."""

    def __init__(self, binary: str, coordinator: ServerProcess, folder: Path) -> None:
        token = folder / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        config = readme_config()
        config["global"] = {"scrape_interval": "500ms", "evaluation_interval": "500ms"}
        config["rule_files"] = [str(RULES)]
        [scrape] = config["scrape_configs"]
        scrape["authorization"]["credentials_file"] = str(token)
        scrape["static_configs"] = [{"targets": [coordinator.url.removeprefix("http://")]}]
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.cmd = [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
            "--log.level=warn",
        ]
        self.log = folder / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Any:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"prometheus not ready: {self.log.read_text()}"
            time.sleep(0.1)
        return self.api

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def api(self, path: str, params: dict[str, str]) -> Any:
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5).json()
        assert reply["status"] == "success", reply
        data = reply["data"]
        return data["result"] if path == "query" else data


def readme_config() -> dict[str, Any]:
    """The README's ``prometheus.yml`` (its "Monitoring with Prometheus" section)."""
    section = (REPO / "README.md").read_text().split("### Monitoring with Prometheus")[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    config: dict[str, Any] = yaml.safe_load(block)
    [scrape] = config["scrape_configs"]
    assert scrape["job_name"] == SCRAPE_JOB and "credentials_file" in scrape["authorization"]
    return config


def wait_for(api: Any, path: str, params: dict[str, str], done: Any, timeout: float = 30) -> Any:
    """Poll the Prometheus API until ``done(data)``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done(data := api(path, params)):
        assert time.monotonic() < deadline, f"{path} {params}: still {data}"
        time.sleep(0.1)
    return data
