"""Lightning with checkflow: a fit SIGKILLed mid-epoch resumes bitwise exact.

Each job is a real process (``_lightning_job.py``): a Lightning fit with
``CheckflowCallback`` (asynchronous checkpoints every few batches) and ``ModelCheckpoint``
exporting the best 2 through ``CheckflowCheckpointIO``. One run goes uninterrupted; others
SIGKILL themselves after a global step in the second epoch and are started again, which
resumes from the newest committed checkpoint. Three kill points, one after the other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning  # noqa: F401 - in the test extra: missing is an error, not a skip
import pytest
import torch
import torchdata  # noqa: F401 - in the test extra: missing is an error, not a skip

from tests.integrations._compare import differing

pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("_lightning_job.py")
REPO = Path(__file__).resolve().parents[2]


def _run(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(JOB), "--dir", str(work / "ckpt"), "--exports",
         str(work / "exports"), "--out", str(work / "final.pt"), *extra],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip


def _final(work: Path) -> dict[str, Any]:
    return torch.load(work / "final.pt", weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lightning-uninterrupted")
    done = _run(work)
    assert done.returncode == 0, done.stderr[-3000:]
    return _final(work)


@pytest.mark.parametrize(
    ("every", "kill_at"),
    # No interval divides the 15 batches of an epoch: a checkpoint at an epoch's last batch
    # resumes with the same data and RNG but not bitwise (see CheckflowCallback's docs).
    [(4, 22), (6, 20), (7, 23)],
    ids=["every4-kill22", "every6-kill20", "every7-kill23"],
)
def test_lightning_fit_killed_mid_epoch_resumes_bitwise_equal(
    tmp_path: Path, uninterrupted: dict[str, Any], every: int, kill_at: int
) -> None:
    killed = _run(tmp_path, "--every", str(every), "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"killing at global step {kill_at}" in killed.stdout

    resumed = _run(tmp_path, "--every", str(every))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = _final(tmp_path)

    # 15 batches an epoch: the kill is in the second epoch, the resume from a checkpoint
    # before it, on the every-N grid.
    assert 0 < final["restored_step"] < kill_at
    assert final["restored_step"] % every == 0
    assert (final["global_step"], final["epoch"]) == (30, 2)
    assert differing(final, uninterrupted, ["params", "optim", "sched", "rng"]) == []
    # Step by step after the restore: the same batch, RNG, parameters and learning rate.
    assert {s: final["seen"][s] for s in final["seen"]} == {
        s: uninterrupted["seen"][s] for s in final["seen"]
    }
    # ModelCheckpoint kept exporting: the same best 2 steps, with bitwise equal scores,
    # and exactly their folders (a worse export replaced by a better one was deleted).
    assert differing(final, uninterrupted, ["best_k", "exports"]) == []
    assert final["exports"] == sorted(final["best_k"])
