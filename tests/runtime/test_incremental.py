"""Incremental checkpoints in the runtime: delta chains survive SIGKILL; lossy q8/q4
restores during training end within 1 % of the uninterrupted run's loss."""

from __future__ import annotations

import pytest

from checkflow import Checkpointer, list_checkpoints
from tests.runtime._train import DLRM, assert_bitwise_equal, load_final, run_train, run_until_killed
from tests.support.paths import load_example

dlrm = load_example("dlrm")

pytestmark = pytest.mark.slow


def test_delta_chain_killed_and_resumed_from_its_last_delta_is_bitwise_equal(tmp_path):
    ref_dir, ckpt = tmp_path / "ref", tmp_path / "ckpt"
    # Long enough that the run is still going when its newest checkpoint is a delta; the
    # parent kills it then, so the run is far from its end on any machine.
    common = ["--steps", "300", "--every", "5", "--codec", "delta", "--full-every", "100"]
    run_train("--dir", str(ref_dir), *common, "--out", str(tmp_path / "ref.pt"), script=DLRM)

    def newest_is_delta() -> bool:
        infos = list_checkpoints(str(ckpt))
        return bool(infos) and infos[-1].kind == "delta"

    run_until_killed(
        "--dir", str(ckpt), *common, kill_after_step=10, script=DLRM, kill_when=newest_is_delta
    )
    newest = list_checkpoints(str(ckpt))[-1]
    assert newest.kind == "delta" and newest.base_steps
    out = run_train("--dir", str(ckpt), *common, "--out", str(tmp_path / "f.pt"), script=DLRM)
    assert out.splitlines()[0] == f"start step {newest.step}"
    assert_bitwise_equal(load_final(tmp_path / "ref.pt"), load_final(tmp_path / "f.pt"))


def _train(state: dict, steps: range) -> None:
    for _ in steps:
        dlrm.train_step(state)


@pytest.mark.parametrize("codec", ["q8", "q4"])
def test_lossy_restores_during_training_end_within_one_percent_of_uninterrupted(
    tmp_path, codec, record_property
):
    total, restarts = 120, (40, 80)
    reference = dlrm.build()
    _train(reference, range(total))
    expected = dlrm.eval_loss(reference)

    state = dlrm.build()
    step = 0
    for stop in (*restarts, total):
        with Checkpointer(str(tmp_path), state, every=10, codec=codec, keep=3) as ck:
            step = ck.restore()
            for _ in range(step, stop):
                dlrm.train_step(state)
                ck.step()
                ck.wait()  # no skipped checkpoints: every 10th step is restorable
        infos = list_checkpoints(str(tmp_path))
        assert infos[-1].step == stop
        if stop != total:
            assert any(i.kind == "delta" for i in infos), "no delta was written"
            state = dlrm.build()  # a "failure": fresh objects, everything comes from storage
    got = dlrm.eval_loss(state)
    gap = abs(got - expected) / expected
    record_property(f"{codec}_loss_gap", gap)
    print(f"{codec}: final eval loss {got:.6f} vs uninterrupted {expected:.6f}: gap {gap:.4%}")
    assert gap < 0.01
