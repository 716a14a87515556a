"""Schemathesis fuzzes a real coordinator from its OpenAPI document: every endpoint, valid
and invalid input, with and without the token. No response may be a 5xx, and every
response must match the documented status codes and schemas. The document is the app's
own, written to a file here: a coordinator serves it only with ``--docs`` and a token."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkflow_server.app import create_app
from checkflow_server.settings import Settings

from tests.support.coordinator import ServerProcess

pytestmark = pytest.mark.slow

# Starlette answers 405 with the Allow header of the first route matching the path only
# (GET and POST /v1/jobs are two routes), which this check flags; nothing to fix here.
EXCLUDED = "allow_header_conformance"


def schemathesis(
    url: str, headers: list[str], seconds: int, report: Path
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe is not None, "schemathesis is in the test extra: pip install -e .[test]"
    schema = report.parent / f"{report.name}-openapi.json"
    app = create_app(Settings(db=report.parent / f"{report.name}-schema.db", sync_storage=False))
    schema.write_text(json.dumps(app.openapi()))
    cmd = [
        exe,
        "run",
        str(schema),
        "--url",
        url,
        "--checks",
        "all",
        "--exclude-checks",
        EXCLUDED,
        "--max-examples",
        "25",
        "--max-time",
        str(seconds),
        "--seed",
        "7",
        "--workers",
        "1",
        "--request-timeout",
        "10",
        "--report",
        "junit",
        "--report-dir",
        str(report),
    ]
    for h in headers:
        cmd += ["--header", h]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)


def test_fuzzed_api_never_fails_and_matches_its_schema(
    server: ServerProcess, tmp_path: Path
) -> None:
    # 120 s: with 60 s a machine loaded by other work generated only 428 cases and failed the
    # count below; with 240 s a CI run used all of it (the stateful phase fills the time).
    run = schemathesis(server.url, [f"Authorization: Bearer {server.token}"], 120, tmp_path / "a")
    assert run.returncode == 0, run.stdout[-6000:]
    # Every generated case passed every check (not_a_server_error among them).
    passed = re.search(r"(\d+) generated, \1 passed", run.stdout)
    assert passed and int(passed.group(1)) > 500, run.stdout[-3000:]


def test_fuzzed_api_without_token_is_refused_everywhere(
    server: ServerProcess, tmp_path: Path
) -> None:
    run = schemathesis(server.url, [], 20, tmp_path / "b")
    assert run.returncode == 0, run.stdout[-6000:]
    assert re.search(r"(\d+) generated, \1 passed", run.stdout), run.stdout[-3000:]
    with server.http() as http:
        assert http.get("/v1/jobs").json()["jobs"] == []  # nothing got through
