"""A real coordinator for the tests: ``checkflow serve`` in a subprocess or uvicorn in a
thread, and simulated ranks (``python -m tests.support.simulated_rank``) as real client
processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from checkflow_server.app import create_app
from checkflow_server.settings import Settings

from checkflow.protocol import (
    CheckpointList,
    CheckpointPublic,
    EventList,
    EventPublic,
    JobCreate,
    JobPublic,
    RankList,
    RankPublic,
    paths,
)
from tests.support.net import free_port, wait_until
from tests.support.paths import REPO

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVE = "import sys; from checkflow.cli import main; sys.exit(main(sys.argv[1:]))"


class ServerProcess:
    """``checkflow serve`` in a subprocess; restartable on the same port and database."""

    def __init__(
        self, db: Path, token: str | None = TOKEN, options: tuple[str, ...] = (), **env: str
    ) -> None:
        self.db = db
        self.token = token
        self.options = options
        """More ``checkflow serve`` options, e.g. ``("--hang-timeout", "3")``."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "CHECKFLOW_DETECTOR_PERIOD_S": "0.1", **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-c",
            SERVE,
            "serve",
            "--port",
            str(self.port),
            "--db",
            str(self.db),
            "--log-level",
            "warning",
        ]
        env = dict(self.env)
        if self.token:  # the documented way: a --token on the command line warns
            env["CHECKFLOW_TOKEN"] = self.token
        else:
            env.pop("CHECKFLOW_TOKEN", None)
        self.proc = subprocess.Popen([*cmd, *self.options], env=env)
        deadline = time.monotonic() + 30  # a loaded CI machine imports slowly
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "coordinator exited during startup"
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError("coordinator did not start")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, like a crash or an OOM kill."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=5)

    # What a test reads and sets through the API, parsed with the protocol's models.
    def create_job(self, body: JobCreate) -> JobPublic:
        """Create a job ahead of its ranks, with settings they do not send (timeouts)."""
        with self.http() as c:
            r = c.post(paths.path(paths.JOBS), json=body.model_dump(mode="json"))
        r.raise_for_status()
        return JobPublic.model_validate(r.json())

    def job(self, name: str) -> JobPublic:
        return JobPublic.model_validate(self._get(paths.path(paths.JOB, job=name)))

    def checkpoints(self, name: str) -> list[CheckpointPublic]:
        reply = self._get(paths.path(paths.CHECKPOINTS, job=name))
        return CheckpointList.model_validate(reply).checkpoints

    def ranks(self, name: str) -> list[RankPublic]:
        return RankList.model_validate(self._get(paths.path(paths.RANKS, job=name))).ranks

    def events(self, name: str) -> list[EventPublic]:
        return EventList.model_validate(self._get(paths.path(paths.EVENTS, job=name))).events

    def _get(self, path: str) -> object:
        with self.http() as c:
            r = c.get(path)
        r.raise_for_status()
        return r.json()


class ThreadServer:
    """A real uvicorn server in a thread of this process, on a fixed port, restartable."""

    def __init__(self, db: Path, port: int, token: str = TOKEN) -> None:
        self.db, self.port, self.token = db, port, token
        self.url = f"http://127.0.0.1:{port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        app = create_app(
            Settings(db=self.db, token=self.token, sync_storage=False, detector_period_s=0.05)
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        server = self.server
        wait_until(lambda: server.started, timeout=10, what="coordinator start")

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(10)

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return r.json()


@contextmanager
def served(db: Path, **options: Any) -> Iterator[ServerProcess]:
    """A :class:`ServerProcess` (``options``: its keyword arguments) running for the ``with``
    block, stopped after it even when the block fails."""
    server = ServerProcess(db, **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def start_rank(url: str, job: str, rank: int, world: int, *args: str) -> subprocess.Popen[str]:
    """A simulated rank (real CoordinatorClient in its own process); JSON lines on stdout."""
    cmd = [
        sys.executable,
        "-m",
        "tests.support.simulated_rank",
        "--url",
        url,
        "--job",
        job,
        "--rank",
        str(rank),
        "--world-size",
        str(world),
        "--token",
        TOKEN,
        *args,
    ]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}  # the simulator is in tests/, not installed
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
