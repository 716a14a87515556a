"""The RAM tier in one process: what it holds, that a restore reads it and not storage, and
that a damaged RAM copy is read from storage instead, with a warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from checkflow import Checkpointer, list_checkpoints
from checkflow.memory.area import rank_root
from checkflow.read.reader import CheckpointReader
from checkflow.storage import Storage
from tests.runtime._models import small_state, train_step


def _train(storage: Path, ram: Path, steps: int, **options: object) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps with a checkpoint every 2 in both tiers; the final weights."""
    state = small_state()
    with Checkpointer(str(storage), state, every=2, ram_dir=str(ram), **options) as ck:
        for _ in range(steps):
            train_step(state)
            ck.step()
        ck.wait()
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def _restore(storage: Path, ram: Path, **kw: object) -> tuple[Checkpointer, dict]:
    fresh = small_state(seed=7)
    ck = Checkpointer(str(storage), fresh, every=2, ram_dir=str(ram))
    ck.restore(**kw)
    ck.close()
    return ck, fresh


def test_each_checkpoint_is_in_the_ram_tier_as_a_verified_format_1_root_with_its_newest_two(
    tmp_path: Path,
) -> None:
    _train(tmp_path / "ckpt", tmp_path / "ram", 9)
    root = rank_root(str(tmp_path / "ram"), 0)
    assert [c.step for c in list_checkpoints(root)] == [6, 8]  # ram_keep=2
    assert [c.step for c in list_checkpoints(str(tmp_path / "ckpt"))] == [4, 6, 8]  # keep=3
    reader = CheckpointReader(Storage(root))
    assert reader.verify(8) == []
    assert reader.manifest(8).meta == {"tier": "ram", "rank": 0, "world_size": 1}


def test_restore_of_the_agreed_step_reads_the_ram_tier_and_not_storage(tmp_path: Path) -> None:
    weights = _train(tmp_path / "ckpt", tmp_path / "ram", 8)
    ck, fresh = _restore(tmp_path / "ckpt", tmp_path / "ram", step=8)
    assert (ck.current_step, ck.restored_from) == (8, "ram")
    assert ck.storage.reads == 0, "a restore from the RAM tier read storage"
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, weights[k])


def test_restore_without_a_step_takes_the_newest_of_both_tiers_from_ram(tmp_path: Path) -> None:
    _train(tmp_path / "ckpt", tmp_path / "ram", 8)
    ck, _ = _restore(tmp_path / "ckpt", tmp_path / "ram")
    assert (ck.current_step, ck.restored_from) == (8, "ram")


def test_a_damaged_ram_copy_is_read_from_storage_with_a_warning(tmp_path: Path) -> None:
    weights = _train(tmp_path / "ckpt", tmp_path / "ram", 8)
    chunks = Path(rank_root(str(tmp_path / "ram"), 0)) / "step-000000008" / "rank-00000-000.chunks"
    data = bytearray(chunks.read_bytes())
    data[0] ^= 0xFF  # a flipped bit in the first chunk: its checksum no longer matches
    chunks.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="RAM copy of step 8 .* cannot be restored"):
        ck, fresh = _restore(tmp_path / "ckpt", tmp_path / "ram", step=8)
    assert (ck.current_step, ck.restored_from) == (8, "storage")
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, weights[k])


def test_ram_copies_of_another_world_size_are_not_read(tmp_path: Path) -> None:
    _train(tmp_path / "ckpt", tmp_path / "ram", 8)
    root = Path(rank_root(str(tmp_path / "ram"), 0))
    manifest = root / "step-000000008" / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"world_size":1}', '"world_size":2}', 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not read, so no damage is reported either
        ck, _ = _restore(tmp_path / "ckpt", tmp_path / "ram")
    assert (ck.current_step, ck.restored_from) == (8, "storage")


def test_ram_keep_must_be_one_or_two() -> None:
    with pytest.raises(ValueError, match="ram_keep must be 1 or 2"):
        Checkpointer("memory://x", small_state(), ram_keep=3)
