"""Crafted manifests: every reader refuses them through the one validator (``validate``).

Each test writes a real checkpoint with a real ``Checkpointer``, edits one manifest the way
an attacker or a crashed run would, and asserts the exact outcome: the error text, the
CLI's exit code and single line, the step ``restore()`` falls back to, the files gc leaves.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from checkflow import Checkpointer, load
from checkflow import manifest as mf
from checkflow.catalog import scan
from checkflow.restore import CheckpointReader
from checkflow.storage import Storage
from checkflow.validate import DamagedStepError
from tests.support.crafted import W, model_state, one_line_error, run_cli, write_steps

# Re-exported: the other adversarial modules tamper with the same small run.
_state, _write = model_state, write_steps


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path / "run"
    return root, _write(root)


def _gpath(root: Path, step: int) -> Path:
    return root / mf.step_dir(step) / mf.MANIFEST


def _rpath(root: Path, step: int) -> Path:
    return root / mf.step_dir(step) / mf.rank_manifest_name(0)


def _edit(path: Path, change: Any) -> None:
    raw = json.loads(path.read_bytes())
    change(raw)
    path.write_text(json.dumps(raw))


def _chunk(raw: dict[str, Any], fqn: str = W) -> dict[str, Any]:
    return next(c for c in raw["chunks"] if c["fqn"] == fqn)


def _edit_chunk(root: Path, step: int, **fields: Any) -> None:
    _edit(_rpath(root, step), lambda raw: _chunk(raw).update(fields))


def _restored_step(root: Path) -> tuple[int | None, dict[str, Any]]:
    fresh = _state()
    with (
        pytest.warns(UserWarning, match="falling back"),
        Checkpointer(str(root), fresh, every=1, keep=0) as ck,
    ):
        return ck.restore(), fresh


def _assert_falls_back_to(root: Path, step: int, saved: list[dict[str, torch.Tensor]]) -> None:
    got, fresh = _restored_step(root)
    assert got == step
    for k, v in saved[step - 1].items():
        assert torch.equal(fresh["model"].state_dict()[k], v)


# -- the layout of a tensor's chunks -------------------------------------------------------------
def _two_halves_of_the_same_rows(root: Path, step: int) -> None:
    """Step's weight as two chunks that both hold rows 0..31, checksums valid: their sizes
    add up to the tensor's, so a sum-based coverage check passes it."""

    def change(raw: dict[str, Any]) -> None:
        c = _chunk(raw)
        half = c["nbytes"] // 2
        data = (root / mf.step_dir(step) / c["file"]).read_bytes()
        first = data[c["byte_offset"] : c["byte_offset"] + half]
        c.update(shape=[32, 8], nbytes=half, checksum=xxhash.xxh3_64_hexdigest(first))
        raw["chunks"].append(dict(c))

    _edit(_rpath(root, step), change)


def test_two_chunks_of_the_same_rows_are_refused_by_verify_load_and_restore(ckpt):
    root, saved = ckpt
    _two_halves_of_the_same_rows(root, 3)
    with pytest.raises(DamagedStepError, match=r"step 3, rank 0, tensor 'model.weight'.*overlaps"):
        load(str(root), 3)
    r = run_cli("verify", str(root), "--step", "3")
    assert r.returncode == 1
    assert "FAIL step 3: step 3, rank 0, tensor 'model.weight', file rank-00000-000.chunks" in (
        r.stdout
    )
    assert "overlaps rank 0's chunk at [0, 0] of shape [32, 8]" in r.stdout
    assert one_line_error(r).startswith("verification failed: 1 of 1 checkpoint(s)")
    _assert_falls_back_to(root, 2, saved)


def test_a_missing_half_is_a_gap(ckpt):
    root, saved = ckpt
    _two_halves_of_the_same_rows(root, 3)
    _edit(_rpath(root, 3), lambda raw: raw["chunks"].pop())
    with pytest.raises(DamagedStepError, match=r"chunks cover 256 of 512 elements"):
        load(str(root), 3)
    _assert_falls_back_to(root, 2, saved)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"offset": [-32, 0]}, "is negative"),
        ({"offset": [0]}, "do not both have the 2 dimensions of global_shape"),
        ({"shape": [-64, 8]}, "is negative"),
        ({"offset": [32, 0]}, "exceeds global_shape [64, 8]"),
        ({"global_shape": [1 << 40, 8], "shape": [64, 8]}, "larger than 4 TiB"),
        ({"dtype": "float1024"}, "unknown dtype 'float1024'"),
        ({"file": "../../etc/passwd"}, "is not a plain name inside the step folder"),
        ({"byte_offset": -1}, "byte range -1+"),
        ({"nbytes": "2048"}, "field 'nbytes' must be an integer, got str"),
        ({"offset": [0, True]}, "field 'offset' must be a list of integers"),
    ],
)
def test_impossible_chunk_entries_are_refused_with_step_rank_tensor_and_file(ckpt, fields, problem):
    root, saved = ckpt
    _edit_chunk(root, 3, **fields)
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1
    assert problem in r.stdout, r.stdout
    assert "step 1: OK" in r.stdout and "step 2: OK" in r.stdout
    assert one_line_error(r).startswith("verification failed: 1 of 3 checkpoint(s)")
    with pytest.raises(mf.ManifestError, match="step 3|rank-00000.json"):
        load(str(root), 3)
    _assert_falls_back_to(root, 2, saved)


def test_unknown_codec_in_an_old_step_does_not_stop_verify_all(ckpt):
    root, saved = ckpt
    _edit_chunk(root, 1, codec="rot13")
    _edit_chunk(root, 2, dtype="complex4096")
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1
    assert "unknown codec 'rot13'" in r.stdout and "unknown dtype 'complex4096'" in r.stdout
    assert "step 3: OK" in r.stdout
    assert one_line_error(r).startswith("verification failed: 2 of 3 checkpoint(s)")


def test_restore_falls_back_past_an_unknown_codec(ckpt):
    root, saved = ckpt
    _edit_chunk(root, 3, codec="rot13")
    _assert_falls_back_to(root, 2, saved)


# -- the global manifest --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"world_size": 0}, "world_size 0 is not between 1 and 1048576"),
        ({"world_size": -3}, "world_size -3 is not between 1"),
        ({"world_size": "1"}, "field 'world_size' must be an integer, got str"),
        ({"base_steps": 5}, "field 'base_steps' must be a list of integers, got int"),
        ({"step": 2}, "says step 2, but sits in the folder of step 3"),
        ({"ranks": [1]}, "field 'ranks' must be a list of strings"),
        ({"kind": "everything"}, "kind 'everything' is neither"),
    ],
)
def test_a_damaged_commit_is_reported_and_the_rest_of_the_root_stays_usable(ckpt, change, problem):
    root, saved = ckpt
    _edit(_gpath(root, 3), lambda raw: raw.update(change))
    cat = scan(Storage(str(root)))
    assert sorted(cat.committed) == [1, 2] and problem in cat.damaged[3]
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1 and "FAIL step 3: " in r.stdout and problem in r.stdout
    assert "step 1: OK" in r.stdout and "step 2: OK" in r.stdout
    r = run_cli("ls", str(root))
    assert r.returncode == 0 and "Traceback" not in r.stderr
    r = run_cli("inspect", str(root), "--step", "2")
    assert r.returncode == 0 and W in r.stdout
    fresh = _state()
    with Checkpointer(str(root), fresh, every=1, keep=0) as ck:
        assert ck.restore() == 2  # the damaged commit is not a candidate at all


def test_gc_leaves_a_damaged_commit_alone_in_one_line(ckpt):
    root, _ = ckpt
    _edit(_gpath(root, 2), lambda raw: raw.update(base_steps=5))
    r = run_cli("gc", str(root), "--keep", "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "deleted step 1 (full" in r.stdout
    assert "left step(s) 2 alone: their MANIFEST.json cannot be read" in r.stdout
    assert sorted(p.name for p in root.iterdir()) == [mf.step_dir(2), mf.step_dir(3)]
    assert _gpath(root, 2).exists()


# -- size and nesting -----------------------------------------------------------------------------
def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


@pytest.mark.parametrize("which", ["global", "rank"])
def test_deep_nesting_in_an_old_step_bricks_nothing(ckpt, which):
    root, saved = ckpt
    path = _gpath(root, 1) if which == "global" else _rpath(root, 1)
    path.write_bytes(b'{"version": 1, "step": ' + _deep(200_000) + b"}")
    r = run_cli("ls", str(root))
    assert r.returncode == 0 and "Traceback" not in r.stderr
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1 and "nests deeper than 64 levels" in r.stdout
    assert "step 2: OK" in r.stdout and "step 3: OK" in r.stdout
    one_line_error(r)
    with pytest.raises(mf.ManifestError, match="nests deeper than 64 levels"):
        load(str(root), 1)
    r = run_cli("inspect", str(root), "--step", "1")
    assert r.returncode == 1 and "nests deeper than 64 levels" in one_line_error(r)
    r = run_cli("gc", str(root), "--keep", "2")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    kept = [mf.step_dir(s) for s in ((1, 2, 3) if which == "global" else (2, 3))]
    assert sorted(p.name for p in root.iterdir()) == kept  # a damaged commit stays


def test_a_huge_sparse_manifest_is_refused_without_being_read(ckpt):
    root, saved = ckpt
    path = _gpath(root, 2)
    with open(path, "r+b") as f:
        f.truncate(512 << 20)  # sparse: 512 MiB stated, nothing on disk
    tracemalloc.start()
    try:
        cat = scan(Storage(str(root)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the file was never read
    assert sorted(cat.committed) == [1, 3]
    assert "is 536870912 bytes, larger than the 67108864-byte cap" in cat.damaged[2]
    r = run_cli("ls", str(root))
    assert r.returncode == 0 and "Traceback" not in r.stderr
    r = run_cli("verify", str(root), "--step", "2")
    assert r.returncode == 1 and "CHECKFLOW_MAX_MANIFEST_BYTES" in r.stdout


def test_a_huge_rank_manifest_is_refused_within_the_cap(ckpt, monkeypatch):
    root, saved = ckpt
    with open(_rpath(root, 3), "r+b") as f:
        f.truncate(512 << 20)
    tracemalloc.start()
    try:
        problems = CheckpointReader(Storage(str(root))).verify(3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert len(problems) == 1 and "larger than the 67108864-byte cap" in problems[0]
    _assert_falls_back_to(root, 2, saved)


# -- delta chains ---------------------------------------------------------------------------------
@pytest.fixture
def deltas(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path / "run"
    saved = _write(root, codec="delta")
    assert json.loads(_gpath(root, 2).read_bytes())["base_steps"] == [1]
    return root, saved


def test_a_delta_that_is_its_own_base_is_refused(deltas):
    root, saved = deltas
    _edit(_gpath(root, 2), lambda raw: raw.update(base_steps=[2]))
    _edit_chunk(root, 2, base_step=2)
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1
    assert "base step 2 is not older than the step itself (a delta chain cycle)" in r.stdout
    assert "step 1: OK" in r.stdout and "step 3: OK" in r.stdout


def test_a_delta_cycle_between_two_steps_is_refused_and_restore_falls_back(deltas):
    root, saved = deltas
    _edit(_gpath(root, 1), lambda raw: raw.update(base_steps=[2], kind="delta"))
    _edit_chunk(root, 1, base_step=2)
    # Step 3 (full) is the newest: make it a delta on the cycle too, so restore must skip 3 and 2.
    _edit(_gpath(root, 3), lambda raw: raw.update(base_steps=[2], kind="delta"))
    _edit_chunk(root, 3, base_step=2)
    with pytest.raises(mf.ManifestError, match="step 1 is damaged: .*a delta chain cycle"):
        load(str(root), 1)
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "FAIL step 1: " in r.stdout and "a delta chain cycle" in r.stdout
    assert one_line_error(r).startswith("verification failed: 3 of 3 checkpoint(s)")
    fresh = _state()
    with (
        pytest.warns(UserWarning, match="could be restored; starting at 0"),
        Checkpointer(str(root), fresh, every=1, keep=0) as ck,
    ):
        # Nothing readable: no cycle followed, no crash, and the chains were refused before
        # any tensor landed in the live model (else restore raises instead of starting over).
        assert ck.restore() == 0


def test_gc_keeps_the_older_steps_a_damaged_base_may_need(deltas):
    root, _ = deltas
    # Step 3 is a delta on step 2, whose commit is damaged: step 2's own bases are unknown.
    _edit(_gpath(root, 3), lambda raw: raw.update(base_steps=[2], kind="delta"))
    _edit_chunk(root, 3, base_step=2)
    _edit(_gpath(root, 2), lambda raw: raw.update(world_size=0))
    r = run_cli("gc", str(root), "--keep", "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert sorted(p.name for p in root.iterdir()) == [mf.step_dir(s) for s in (1, 2, 3)]
    assert os.path.exists(_gpath(root, 1))


# -- the RAM tier ---------------------------------------------------------------------------------
def test_a_ram_copy_with_overlapping_chunks_is_read_from_storage(tmp_path: Path):
    """The RAM tier reads through the same validator: two chunks of the same rows in the
    RAM copy are damage, and the step is read from storage instead."""
    from checkflow.memory.area import rank_root

    state = _state()
    store, ram = tmp_path / "ckpt", tmp_path / "ram"
    with Checkpointer(str(store), state, every=1, ram_dir=str(ram)) as ck:
        with torch.no_grad():
            state["model"].weight.add_(1.0)
        ck.step()
        ck.wait()
    weights = {k: v.clone() for k, v in state["model"].state_dict().items()}
    ram_root = Path(rank_root(str(ram), 0))
    _two_halves_of_the_same_rows(ram_root, 1)
    fresh = _state()
    with (
        pytest.warns(UserWarning, match=r"RAM copy of step 1 .* cannot be restored .*overlaps"),
        Checkpointer(str(store), fresh, every=1, ram_dir=str(ram)) as ck,
    ):
        assert ck.restore(step=1) == 1
        assert ck.restored_from == "storage"
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, weights[k])
