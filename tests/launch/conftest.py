"""Fixtures shared by the launcher's tests that run a job on one or two stand-in nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch._nodes import reference_states
from tests.support.coordinator import ServerProcess, served


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[ServerProcess]:
    """A coordinator of its own for each test (the real ``checkflow serve`` process)."""
    with served(tmp_path / "coordinator.db") as server:
        yield server


@pytest.fixture(scope="module")
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The uninterrupted run's final states (digests per rank) for the module's ``STEPS``,
    computed once per module."""
    return reference_states(tmp_path_factory.mktemp("reference"), request.module.STEPS)
