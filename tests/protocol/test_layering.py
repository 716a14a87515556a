"""The protocol and the coordinator stay off the training runtime: no torch when imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["checkflow.protocol", "checkflow.client", "checkflow_server.app"]
)
def test_importing_pulls_in_no_torch(module: str) -> None:
    code = (
        f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_simulated_rank_is_test_support_not_part_of_the_package() -> None:
    # It moved out of checkflow/client/__main__.py: the installed client has no entry point.
    assert importlib.util.find_spec("checkflow.client.__main__") is None
    assert importlib.util.find_spec("tests.support.simulated_rank") is not None
