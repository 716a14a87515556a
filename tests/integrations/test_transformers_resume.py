"""transformers.Trainer with checkflow: a run SIGKILLed mid-epoch resumes bitwise exact.

Each job is a real process (``_transformers_job.py``): a tiny GPT-2 built from a config
(nothing downloaded, ``HF_HUB_OFFLINE=1``) trained by ``Trainer`` with
``CheckflowTrainerCallback``. One run goes uninterrupted; others SIGKILL themselves after a
global step in the second epoch and are started again with
``resume_from_checkpoint=callback.resume_point()``. Three kill points, one after the other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # noqa: F401 - in the test extra: missing is an error, not a skip

from tests.integrations._compare import differing

pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("_transformers_job.py")
LOGGING_STEPS = 4
"""``TrainingArguments.logging_steps`` of the job."""
REPO = Path(__file__).resolve().parents[2]


def _run(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
    }
    return subprocess.run(
        [sys.executable, str(JOB), "--dir", str(work / "ckpt"), "--out", str(work / "final.pt"),
         *extra],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("transformers-uninterrupted")
    done = _run(work)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(work / "final.pt", weights_only=False)


@pytest.mark.parametrize(
    ("every", "kill_at"),
    [(4, 22), (5, 19), (3, 25)],
    ids=["every4-kill22", "every5-kill19", "every3-kill25"],
)
def test_hf_trainer_killed_mid_epoch_resumes_bitwise_equal(
    tmp_path: Path, uninterrupted: dict[str, Any], every: int, kill_at: int
) -> None:
    killed = _run(tmp_path, "--every", str(every), "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"killing at global step {kill_at}" in killed.stdout

    resumed = _run(tmp_path, "--every", str(every))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(tmp_path / "final.pt", weights_only=False)

    # 15 optimizer steps an epoch: the kill is in the second epoch, the resume from a
    # committed checkpoint before it.
    assert 0 < final["restored_step"] < kill_at
    assert final["restored_step"] % every == 0
    assert (final["global_step"], final["epoch"]) == (30, 2.0)
    # Parameters, AdamW moments and step counts, the schedule and the RNG: every bit.
    assert differing(final, uninterrupted, ["params", "optim", "sched", "rng"]) == []
    # The log history too, every 4 steps (the checkpoint is taken after its step's log
    # entry). One exception: when the restored step is not on that grid, the first loss
    # logged after it averages only the steps since the restore. The Trainer's running
    # loss is not part of its state, as after its own checkpoints.
    restored = final["restored_step"]
    first_log_after = (restored // LOGGING_STEPS + 1) * LOGGING_STEPS
    skip = {first_log_after} if restored % LOGGING_STEPS else set()
    logged = {"losses": {s: v for s, v in final["losses"].items() if s not in skip}}
    expected = {"losses": {s: v for s, v in uninterrupted["losses"].items() if s not in skip}}
    assert sorted(final["losses"]) == sorted(uninterrupted["losses"])
    assert differing(logged, expected, ["losses"]) == []
    # (Not compared: TrainOutput.training_loss and train_runtime, which the Trainer
    # computes over the steps of this train() call only, as after its own resumes.)
