"""The README's coordinator journey, run as a user runs it: a real ``checkflow serve``, then
``examples/train.py --coordinator URL --job J`` as a child process with the token in
``CHECKFLOW_TOKEN`` or ``--token-file``, and what the coordinator saw read back through its
API. Before settings resolved one by one, the script's own ``--coordinator``/``--job`` made
the ``Checkpointer`` ignore ``CHECKFLOW_TOKEN``: every call got 401 and the run went on
unmonitored, so these fail on that code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow.cli.output import TOKEN_ON_COMMAND_LINE
from checkflow.protocol import JobCreate, paths
from checkflow.protocol.messages import JobCreated
from tests.runtime._train import TRAIN
from tests.support.coordinator import TOKEN, ServerProcess, served

STEPS, EVERY = 30, 10
NO_TOKEN = "no token was sent and this coordinator wants one"
WRONG_TOKEN = "the token sent is not this coordinator's"


def train(url: str, job: str, root: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    """``examples/train.py`` against the coordinator at ``url``; ``env`` replaces any
    ``CHECKFLOW_*`` of the test's own environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHECKFLOW_")}
    cmd = [sys.executable, str(TRAIN), "--dir", str(root / "ckpt"), "--steps", str(STEPS)]
    cmd += ["--every", str(EVERY), "--keep", "0", "--coordinator", url, "--job", job, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**clean, **env})


def committed_steps(server: ServerProcess, job: str) -> list[int]:
    return sorted(c.step for c in server.checkpoints(job) if c.status == "committed")


def job_token(server: ServerProcess, job: str) -> str:
    """A token of ``job`` only, as ``checkflow run`` would get for its workers."""
    with server.http() as http:
        r = http.post(paths.path(paths.JOBS), json=JobCreate(name=job, world_size=1).model_dump())
    r.raise_for_status()
    token = JobCreated.model_validate(r.json()).token
    assert token is not None and token.startswith("cfj_")
    return token


def test_the_token_in_the_environment_reaches_the_coordinator_with_coordinator_and_job_given(
    tmp_path,
):
    with served(tmp_path / "coord.db") as server:
        proc = train(server.url, "journey", tmp_path, CHECKFLOW_TOKEN=TOKEN)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "401" not in proc.stderr, proc.stderr[-3000:]
        assert committed_steps(server, "journey") == [10, 20, 30]
        [rank] = server.ranks("journey")
        # it registered, reported its steps and said it finished: the run was watched
        assert (rank.rank, rank.state) == (0, "finished")
        assert rank.step >= STEPS - 1 and rank.last_heartbeat is not None


def test_a_token_file_beats_a_wrong_token_in_the_environment_and_a_job_token_suffices(tmp_path):
    with served(tmp_path / "coord.db") as server:
        token_file = tmp_path / "job.token"
        token_file.write_text(job_token(server, "scoped") + "\n")
        token_file.chmod(0o600)
        proc = train(
            server.url,
            "scoped",
            tmp_path,
            "--token-file",
            str(token_file),
            CHECKFLOW_TOKEN="wrong",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "401" not in proc.stderr and TOKEN_ON_COMMAND_LINE not in proc.stderr
        assert committed_steps(server, "scoped") == [10, 20, 30]


@pytest.mark.parametrize(
    ("env", "hint"), [({"CHECKFLOW_TOKEN": "wrong"}, WRONG_TOKEN), ({}, NO_TOKEN)]
)
def test_a_refused_token_says_what_to_do_given_what_was_sent(tmp_path, env, hint):
    with served(tmp_path / "coord.db") as server:
        proc = train(server.url, "refused", tmp_path, **env)
        assert proc.returncode == 0, proc.stderr[-3000:]  # training goes on, said loudly
        assert "HTTP 401" in proc.stderr and hint in proc.stderr, proc.stderr[-3000:]
        other = NO_TOKEN if hint == WRONG_TOKEN else WRONG_TOKEN
        assert other not in proc.stderr
        with server.http() as http:
            assert http.get(paths.path(paths.JOB, job="refused")).status_code == 404


def test_a_token_on_the_command_line_warns_and_is_used(tmp_path):
    with served(tmp_path / "coord.db") as server:
        proc = train(server.url, "argv", tmp_path, "--token", TOKEN)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr.count(f"checkflow: warning: {TOKEN_ON_COMMAND_LINE}") == 1
        assert committed_steps(server, "argv") == [10, 20, 30]


def test_an_unreadable_token_file_stops_the_script_with_one_line(tmp_path):
    proc = train("http://127.0.0.1:9", "j", tmp_path, "--token-file", str(tmp_path / "absent"))
    assert proc.returncode == 2
    assert f"cannot read the token file {tmp_path / 'absent'}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists()
