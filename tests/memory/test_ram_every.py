"""``ram_every``: the RAM tier takes steps of its own while storage keeps ``every``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkflow import Checkpointer, list_checkpoints
from checkflow.memory.area import rank_root
from tests.runtime._models import small_state, train_step


def test_ram_every_step_keeps_the_newest_steps_in_ram_while_storage_keeps_its_interval(
    tmp_path: Path,
) -> None:
    state = small_state()
    ram = str(tmp_path / "ram")
    with Checkpointer(str(tmp_path / "ckpt"), state, every=4, ram_dir=ram, ram_every=1) as ck:
        for _ in range(7):
            train_step(state)
            ck.step()
        ck.wait()
        assert (ck.stats.due, ck.stats.taken) == (1, 1), "RAM-only steps are not counted"
    weights = {k: v.clone() for k, v in state["model"].state_dict().items()}
    assert [c.step for c in list_checkpoints(rank_root(ram, 0))] == [6, 7]
    assert [c.step for c in list_checkpoints(str(tmp_path / "ckpt"))] == [4]

    fresh = small_state(seed=3)
    with Checkpointer(str(tmp_path / "ckpt"), fresh, every=4, ram_dir=ram) as ck:
        assert ck.restore() == 7 and ck.restored_from == "ram"
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, weights[k])


def test_ram_every_must_be_a_positive_int() -> None:
    with pytest.raises(ValueError, match="ram_every must be a positive int"):
        Checkpointer("memory://x", small_state(), ram_every=0)
