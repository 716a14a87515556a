"""Fixtures of the coordinator tests: an in-process app (TestClient) and a real uvicorn
server in a subprocess, plus simulated ranks (``python -m tests.support.simulated_rank``) as real
client processes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkflow_server.app import create_app
from checkflow_server.settings import Settings
from fastapi.testclient import TestClient

from checkflow.cli.output import StderrHandler
from tests.support.coordinator import AUTH, TOKEN, ServerProcess, served
from tests.support.postgres import Cluster


@pytest.fixture
def pg_url(postgres_cluster: Cluster) -> str:
    """A new, empty PostgreSQL database of this test: ``postgresql://...``."""
    return postgres_cluster.new_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The coordinator's ``--db`` on each backend: a SQLite path, then a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "c.db")
    cluster: Cluster = request.getfixturevalue("postgres_cluster")
    return cluster.new_database()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        db=tmp_path / "coordinator.db", token=TOKEN, sync_storage=False, detector_period_s=0.05
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), headers=AUTH) as c:
        yield c


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with served(tmp_path / "coordinator.db") as s:
        yield s


@pytest.fixture(autouse=True)
def _serve_logging_undone() -> Iterator[None]:
    """``main(["serve", ...])`` run in-process sets the root logger up for a service (its
    level, a handler on stderr, ``force=True``), as the process it normally is; undone after
    each test, so that later tests' stderr holds only what they wrote."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(handler)
    root.setLevel(level)
