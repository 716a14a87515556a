"""Exactness and crash consistency with real child processes killed by SIGKILL."""

from __future__ import annotations

import pytest

from checkflow import list_checkpoints
from checkflow.manifest import MANIFEST, step_dir
from tests.runtime._train import assert_bitwise_equal, load_final, run_train, run_until_killed

pytestmark = pytest.mark.slow

STEPS = "60"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run's final state."""
    d = tmp_path_factory.mktemp("ref")
    run_train(
        "--dir", str(d / "ckpt"), "--steps", STEPS, "--every", "5", "--out", str(d / "final.pt")
    )
    return load_final(d / "final.pt")


@pytest.mark.parametrize("kill_at", [13, 37])
def test_sigkill_and_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, reference, kill_at):
    ckpt = str(tmp_path / "ckpt")
    killed = run_until_killed(
        "--dir", ckpt, "--steps", STEPS, "--every", "5", kill_after_step=kill_at
    )
    out = run_train(
        "--dir", ckpt, "--steps", STEPS, "--every", "5", "--out", str(tmp_path / "f.pt")
    )
    start = int(out.splitlines()[0].split()[-1])
    assert 0 < start <= killed, out.splitlines()[0]
    resumed = load_final(tmp_path / "f.pt")
    # Parameters, AdamW moments and step counts, scheduler, loader position, final loss:
    # all bitwise equal, which also needs the RNG streams (dropout, noise) to be restored.
    assert_bitwise_equal(reference, resumed)


def test_kill_during_persist_leaves_the_step_uncommitted_and_previous_restores(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    run_train("--dir", str(ckpt), "--steps", "10", "--every", "5")
    before = [c.step for c in list_checkpoints(str(ckpt))]
    assert before, "the first run committed nothing"
    newest = before[-1]
    # The persist of each checkpoint sleeps before committing: we kill inside that window,
    # once the next checkpoint's data and rank manifest are on disk.
    folder = ckpt / step_dir(newest + 5)
    run_until_killed(
        "--dir",
        str(ckpt),
        "--steps",
        STEPS,
        "--every",
        "5",
        kill_after_step=newest + 1,
        env={"CHECKFLOW_TEST_COMMIT_DELAY_S": "30"},
        require_commit=False,
        wait_for=folder / "rank-00000.json",
    )
    assert (folder / "rank-00000.json").exists()
    assert not (folder / MANIFEST).exists()
    assert [c.step for c in list_checkpoints(str(ckpt))] == before
    out = run_train(
        "--dir", str(ckpt), "--steps", STEPS, "--every", "5", "--out", str(tmp_path / "f.pt")
    )
    assert out.splitlines()[0] == f"start step {newest}"
    assert_bitwise_equal(reference, load_final(tmp_path / "f.pt"))
