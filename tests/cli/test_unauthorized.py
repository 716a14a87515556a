"""What ``checkflow status`` says when a real coordinator refuses its token: the advice
depends on what was sent (no token: how to give one; a wrong one: check it), never "pass a
token" to someone who passed one. Exit 1, one line, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from checkflow.cli.output import EXIT_USAGE
from tests.support.coordinator import TOKEN, served

CLI = "import sys; from checkflow.cli import main; sys.exit(main(sys.argv[1:]))"


def status(url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHECKFLOW_")}
    return subprocess.run(
        [sys.executable, "-c", CLI, "status", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {},
            "checkflow: error: the coordinator refused: no token was sent and this "
            "coordinator wants one",
        ),
        (
            {"CHECKFLOW_TOKEN": "wrong"},
            "checkflow: error: the coordinator refused: the token sent is not this coordinator's",
        ),
    ],
)
def test_a_refused_status_says_what_to_do_given_what_was_sent(tmp_path, env, expected):
    with served(tmp_path / "coord.db") as server:
        refused = status(server.url, **env)
        accepted = status(server.url, CHECKFLOW_TOKEN=TOKEN)
    assert refused.returncode == EXIT_USAGE, refused.stderr
    assert refused.stderr.startswith(expected), refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    assert accepted.returncode == 0, accepted.stderr


def test_a_token_file_beats_a_wrong_variable(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    with served(tmp_path / "coord.db") as server:
        proc = status(server.url, "--token-file", str(path), CHECKFLOW_TOKEN="wrong")
    assert proc.returncode == 0, proc.stderr
