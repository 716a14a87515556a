"""Fixtures of the dashboard tests: a real coordinator (``checkflow serve`` in a subprocess,
with a token) and a fresh headless Chromium per test, driven by Playwright.

The browser is Debian's ``chromium`` (``.ci/run`` installs it): Playwright's own browser
download is never used, and the flags keep Chromium off the network (this machine has
none; without them its background connections are refused and slow it down).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import BrowserContext, Playwright, sync_playwright

from tests.support.coordinator import ServerProcess

CHROMIUM = Path(os.environ.get("CHECKFLOW_CHROMIUM", "/usr/bin/chromium"))
"""Debian's chromium; another build of Chromium with ``CHECKFLOW_CHROMIUM``."""
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One coordinator for the module (it takes seconds to start); each test makes its own
    job. It retunes often, so that the interval plot has changes within a test."""
    db = tmp_path_factory.mktemp("dashboard") / "coordinator.db"
    s = ServerProcess(db, CHECKFLOW_RETUNE_PERIOD_S="0.1")
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        why = (
            f"the dashboard tests need Debian's chromium at {CHROMIUM}: "
            "run `apt-get install chromium` (.ci/run does it on CI)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with sync_playwright() as p:
        yield p


@pytest.fixture
def browser(playwright: Playwright, tmp_path: Path) -> Iterator[BrowserContext]:
    """A new Chromium with an empty profile (no cookies): one browser per test."""
    context = playwright.chromium.launch_persistent_context(
        str(tmp_path / "chromium-profile"),
        executable_path=str(CHROMIUM),
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1280, "height": 900},
    )
    context.set_default_timeout(15_000)
    try:
        yield context
    finally:
        context.close()
