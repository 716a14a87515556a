"""The launcher trades the admin token for a job token before its workers start
(``launch/jobtoken.py``), against a real ``checkflow serve``, and ``checkflow run``'s
workers hold only that job token."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from checkflow.client.env import CoordinatorSettings
from checkflow.launch.jobtoken import for_workers
from checkflow.protocol import paths
from tests.support.coordinator import TOKEN, ServerProcess
from tests.support.net import free_port

pytestmark = pytest.mark.slow


def can_read(url: str, token: str, job: str) -> int:
    return httpx.get(
        url + paths.path(paths.JOB, job=job), headers={"Authorization": f"Bearer {token}"}
    ).status_code


def test_the_admin_token_is_traded_for_one_of_this_job_only(coordinator: ServerProcess) -> None:
    url = coordinator.url
    with coordinator.http() as admin:
        for name in ("mine", "other"):
            assert admin.post(
                paths.path(paths.JOBS), json={"name": name, "world_size": 1}
            ).is_success
    given = CoordinatorSettings(url=url, job="mine", token=TOKEN)
    workers = for_workers(given)
    assert workers.url == url and workers.job == "mine"
    assert workers.token is not None and workers.token.startswith("cfj_")
    assert can_read(url, workers.token, "mine") == 200
    assert can_read(url, workers.token, "other") == 403
    # Given a job token, the launcher passes it on as it is.
    assert for_workers(workers) == workers


def test_a_wrong_token_or_no_coordinator_passes_the_given_token_with_a_warning(
    coordinator: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = CoordinatorSettings(url=coordinator.url, job="j", token="wrong")
    down = CoordinatorSettings(url=f"http://127.0.0.1:{free_port()}", job="j", token=TOKEN)
    with caplog.at_level(logging.WARNING, logger="checkflow.launch.jobtoken"):
        assert for_workers(wrong) == wrong
        assert for_workers(down) == down
    first, second = (r.getMessage() for r in caplog.records)
    assert "HTTP 401" in first and "workers get yours" in first
    assert "coordinator unavailable" in second
    assert for_workers(CoordinatorSettings()) == CoordinatorSettings()


def test_checkflow_run_gives_its_workers_a_job_token_not_the_admin_token(
    coordinator: ServerProcess, tmp_path: Path
) -> None:
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    secret.chmod(0o600)
    seen = tmp_path / "seen"
    script = tmp_path / "show.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "pathlib.Path(sys.argv[1]).write_text(os.environ['CHECKFLOW_TOKEN'])\n"
    )
    cmd = [sys.executable, "-m", "checkflow.cli", "run", "--nproc-per-node=1"]
    cmd += ["--coordinator", coordinator.url, "--job", "ran", "--token-file", str(secret)]
    cmd += ["--no-warm-restarts", str(script), str(seen)]
    env = {k: v for k, v in os.environ.items() if k != "CHECKFLOW_TOKEN"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    token = seen.read_text()
    assert token.startswith("cfj_") and TOKEN not in token
    assert can_read(coordinator.url, token, "ran") == 404  # its own job: let in, not created yet
    with coordinator.http() as admin:
        admin.post(paths.path(paths.JOBS), json={"name": "else", "world_size": 1})
    assert can_read(coordinator.url, token, "else") == 403
