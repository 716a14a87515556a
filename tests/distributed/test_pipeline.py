"""Pipeline stages save under global names: SIGKILL resume is bitwise, and a checkpoint of
2 stages resumes as 1 or 4 stages and trains on to the same bits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from checkflow import list_checkpoints, load
from tests.distributed._launch import run_ranks
from tests.runtime._train import assert_bitwise_equal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _merged(out: Path, world: int) -> dict:
    state: dict = {}
    for rank in range(world):
        part = torch.load(f"{out}.{rank}", weights_only=False)
        assert not state.keys() & part.keys(), "two stages hold the same entry"
        state.update(part)
    return state


def test_two_stage_pipeline_resumes_bitwise_after_sigkill_and_on_other_splits(tmp_path):
    base = {"scenario": "pipeline", "steps": 6, "every": 2}
    run_ranks(2, {**base, "uri": str(tmp_path / "ref"), "out": str(tmp_path / "ref")})
    reference = _merged(tmp_path / "ref", 2)
    assert any(k.startswith("optim.state.layers.3.") for k in reference)

    uri = tmp_path / "run"
    killed = {**base, "uri": str(uri), "kill": {"rank": 1, "after_step": 5}}
    run_ranks(2, killed, expect_killed=True)
    assert [c.step for c in list_checkpoints(str(uri))] == [2, 4]
    # The consolidated view (checkflow.load, `checkflow restore`) joins the stages.
    layers = {k for k in load(str(uri), 4)["stage"] if k.startswith("model.")}
    assert layers == {f"model.layers.{i}.{p}" for i in range(4) for p in ("weight", "bias")}
    for world in (1, 4):
        shutil.copytree(uri, tmp_path / f"split-{world}")

    run_ranks(2, {**base, "uri": str(uri), "out": str(tmp_path / "resumed")})
    assert_bitwise_equal(_merged(tmp_path / "resumed", 2), reference, "2 stages")

    for world in (1, 4):
        out = tmp_path / f"resumed-{world}"
        run_ranks(world, {**base, "uri": str(tmp_path / f"split-{world}"), "out": str(out)})
        assert_bitwise_equal(_merged(out, world), reference, f"{world} stages")
