"""A restore on CPU decodes each chunk straight into the live parameter or optimizer state
it belongs to: the same tensors, refilled bit for bit, for every codec and for tensors
split into several chunks; a read that fails after refilling some says so."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from checkflow import Checkpointer, knobs, load
from checkflow.manifest import RankManifest, rank_manifest_name, step_dir
from tests.runtime._models import small_state, train_step


def _save(root: Path, state: dict[str, Any], codec: str, steps: int = 2) -> None:
    with Checkpointer(str(root), state, every=1, keep=0, codec=codec) as ck:
        for _ in range(steps):
            train_step(state)
            ck.step()
            ck.wait()


def _live(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor a restore can refill: the model's state and the optimizer's."""
    out = {f"model.{k}": v for k, v in state["model"].state_dict(keep_vars=True).items()}
    params = [p for g in state["optim"].param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in state["optim"].state[p].items():
            out[f"optim.{i}.{k}"] = v
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("codec", ["exact", "zstd", "q8"])
def test_a_restore_refills_the_live_tensors_in_place(tmp_path: Path, codec: str) -> None:
    state = small_state()
    with knobs.override(CHECKFLOW_CHUNK_BYTES=256):  # tensors of several chunks
        _save(tmp_path, state, codec)
    saved = load(str(tmp_path))
    chunks = RankManifest.from_json(
        (tmp_path / step_dir(2) / rank_manifest_name(0)).read_bytes()
    ).chunks
    assert len(chunks) > len({c.fqn for c in chunks})  # some tensor has several chunks
    train_step(state)  # the live state moves on
    before = {k: (id(t), t.data_ptr()) for k, t in _live(state).items()}

    with Checkpointer(str(tmp_path), state, every=1, keep=0) as ck:
        assert ck.restore() == 2

    live = _live(state)
    assert {k: (id(t), t.data_ptr()) for k, t in live.items()} == before
    for k, v in saved["model"].items():
        assert torch.equal(_bits(live[f"model.{k}"]), _bits(v)), k
    for i, entries in saved["optim"]["state"].items():
        for k, v in entries.items():
            assert torch.equal(_bits(live[f"optim.{i}.{k}"]), _bits(v)), (i, k)
    train_step(state)  # and training goes on


def test_a_failed_restore_that_already_refilled_live_tensors_says_so(tmp_path: Path) -> None:
    """A chunk found corrupt after others were decoded into the live tensors leaves them
    mixed; with no older checkpoint to fall back to, the restore fails instead of training
    on from step 0 with part of a checkpoint in the model."""
    state = small_state()
    _save(tmp_path, state, "exact", steps=1)
    rm = RankManifest.from_json((tmp_path / step_dir(1) / rank_manifest_name(0)).read_bytes())
    last = [c for c in rm.chunks if c.fqn.startswith("optim.")][-1]  # read after the model
    with open(tmp_path / step_dir(1) / last.file, "r+b") as f:
        f.seek(last.byte_offset)
        first = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([first[0] ^ 0xFF]))

    with (
        Checkpointer(str(tmp_path), state, every=1, keep=0) as ck,
        pytest.warns(UserWarning, match="falling back"),
        pytest.raises(RuntimeError, match="create them anew"),
    ):
        ck.restore()


def test_a_restore_that_fails_before_any_tensor_starts_at_0_untouched(tmp_path: Path) -> None:
    """A checkpoint whose manifest is damaged is refused before a tensor is read: the live
    state is untouched and training starts at step 0, as before in-place restores."""
    state = small_state()
    _save(tmp_path, state, "exact", steps=1)
    (tmp_path / step_dir(1) / rank_manifest_name(0)).write_bytes(b"{not json")
    fresh = small_state(seed=1)
    untouched = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    with (
        Checkpointer(str(tmp_path), fresh, every=1, keep=0) as ck,
        pytest.warns(UserWarning, match="could be restored"),
    ):
        assert ck.restore() == 0
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, untouched[k]), k
