"""Lightning with checkflow: a fit SIGKILLed mid-epoch resumes bitwise exact.

Each job is a real process (``_lightning_job.py``): a Lightning fit with
``CheckflowCallback`` (asynchronous checkpoints every few batches) and ``ModelCheckpoint``
exporting the best 2 through ``CheckflowCheckpointIO``. One run goes uninterrupted; others
SIGKILL themselves after a global step in the second epoch and are started again, which
resumes from the newest committed checkpoint: three kill points after a checkpoint inside an
epoch, and one after a checkpoint at the last batch of the first epoch.
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


def _kill_and_resume(work: Path, every: int, kill_at: int) -> dict[str, Any]:
    """Run the job until it SIGKILLs itself after global step ``kill_at``, then again."""
    killed = _run(work, "--every", str(every), "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"killing at global step {kill_at}" in killed.stdout

    resumed = _run(work, "--every", str(every))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return _final(work)


def _assert_resumed_like_uninterrupted(
    final: dict[str, Any], uninterrupted: dict[str, Any]
) -> None:
    """Bitwise the uninterrupted run's state, and its steps and hooks after the restore."""
    assert (final["global_step"], final["epoch"]) == (30, 2)
    assert differing(final, uninterrupted, ["params", "optim", "sched", "rng", "loops"]) == []
    # Step by step after the restore: the same batch, RNG, parameters and learning rate.
    assert {s: final["seen"][s] for s in final["seen"]} == {
        s: uninterrupted["seen"][s] for s in final["seen"]
    }
    # The epoch hooks the uninterrupted run called from the restored step on, in order.
    restored = final["restored_step"]
    assert final["epoch_hooks"] == [h for h in uninterrupted["epoch_hooks"] if h[2] >= restored]
    # ModelCheckpoint kept exporting: the same best 2 steps, with bitwise equal scores,
    # and exactly their folders (a worse export replaced by a better one was deleted).
    assert differing(final, uninterrupted, ["best_k", "exports"]) == []
    assert final["exports"] == sorted(final["best_k"])


@pytest.mark.parametrize(
    ("every", "kill_at"),
    # No interval divides the 15 batches of an epoch: every checkpoint is inside an epoch.
    [(4, 22), (6, 20), (7, 23)],
    ids=["every4-kill22", "every6-kill20", "every7-kill23"],
)
def test_lightning_fit_killed_mid_epoch_resumes_bitwise_equal(
    tmp_path: Path, uninterrupted: dict[str, Any], every: int, kill_at: int
) -> None:
    final = _kill_and_resume(tmp_path, every, kill_at)
    # 15 batches an epoch: the kill is in the second epoch, the resume from a checkpoint
    # before it, on the every-N grid.
    assert 0 < final["restored_step"] < kill_at
    assert final["restored_step"] % every == 0
    _assert_resumed_like_uninterrupted(final, uninterrupted)


def test_lightning_fit_killed_after_checkpoint_at_epochs_last_batch_resumes_bitwise_equal(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    # Every 15 batches: the only checkpoint before the kill is at global step 15, the
    # last batch of the first epoch. The resumed run ends that epoch (its
    # on_train_epoch_end), starts the next (on_train_epoch_start, a new train iterator
    # drawing its seed from the same RNG state) and trains it as the uninterrupted run did.
    final = _kill_and_resume(tmp_path, 15, 25)
    assert final["restored_step"] == 15
    assert final["epoch_hooks"][:2] == [("end", 0, 15), ("start", 1, 15)]
    _assert_resumed_like_uninterrupted(final, uninterrupted)
