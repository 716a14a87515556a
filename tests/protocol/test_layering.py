"""The protocol and the coordinator stay off the training runtime: no torch when imported."""

from __future__ import annotations

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
