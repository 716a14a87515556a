"""``import checkflow`` never needs a trainer package: each integration imports its own."""

from __future__ import annotations

import subprocess
import sys

TRAINERS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torchdata")


def test_checkflow_and_its_integrations_package_import_no_trainer() -> None:
    code = (
        "import sys, checkflow, checkflow.integrations\n"
        "from checkflow import Checkpointer, load\n"
        f"print(sorted(m for m in {TRAINERS!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
