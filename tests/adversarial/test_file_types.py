"""Crafted entries in a local checkpoint root: FIFOs, symbolic links and look-alike names.

Each test writes a real checkpoint with a real ``Checkpointer``, plants one entry the way
an attacker or a careless ``ln -s`` would, and asserts the exact outcome: nothing hangs
(every CLI call has a timeout), nothing outside the root is read, written or deleted, and
gc deletes exactly the step folders the catalog listed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from checkflow import Checkpointer, load
from checkflow import manifest as mf
from checkflow.catalog import scan
from checkflow.read.errors import CorruptCheckpointError
from checkflow.storage import Storage, StorageError
from tests.support.crafted import STEPS, one_line_error, run_cli
from tests.support.crafted import model_state as _state
from tests.support.crafted import write_steps as _write

CHUNKS = mf.rank_chunks_name(0, 0)


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path / "run"
    return root, _write(root)


def _folder(root: Path, step: int) -> Path:
    return root / mf.step_dir(step)


def _restore(root: Path) -> tuple[int | None, dict[str, Any]]:
    fresh = _state()
    with Checkpointer(str(root), fresh, every=1, keep=0) as ck:
        return ck.restore(), fresh


def _assert_restores(root: Path, step: int, saved: list[dict[str, torch.Tensor]]) -> None:
    got, fresh = _restore(root)
    assert got == step
    for k, v in saved[step - 1].items():
        assert torch.equal(fresh["model"].state_dict()[k], v)


def _fifo_instead_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


# -- FIFOs ----------------------------------------------------------------------------------------
def test_a_fifo_named_manifest_is_damage_not_a_hang(ckpt):
    root, saved = ckpt
    _fifo_instead_of(_folder(root, 3) / mf.MANIFEST)
    r = run_cli("ls", str(root))
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "1 step folder(s) whose MANIFEST.json cannot be read" in r.stdout
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1
    assert "MANIFEST.json is a FIFO, not a file; refusing it" in r.stdout
    assert "step 1: OK" in r.stdout and "step 2: OK" in r.stdout
    assert one_line_error(r).startswith("verification failed: 1 of 3 checkpoint(s)")
    _assert_restores(root, 2, saved)


def test_a_fifo_standing_in_for_a_chunk_file_is_damage_not_a_hang(ckpt):
    root, saved = ckpt
    _fifo_instead_of(_folder(root, 3) / CHUNKS)
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1
    assert f"{CHUNKS} is a FIFO, not a file; refusing it" in r.stdout
    assert "step 2: OK" in r.stdout
    with pytest.raises(CorruptCheckpointError, match=f"file {CHUNKS}: .* is a FIFO, not a file"):
        load(str(root), 3)
    with pytest.warns(UserWarning, match="falling back"):
        _assert_restores(root, 2, saved)


def test_close_with_retention_finishes_beside_a_fifo_manifest(tmp_path: Path):
    """``Checkpointer.close()`` scans the root for retention: a FIFO there once blocked it
    forever. The scan must treat it as a damaged commit and keep going (and keep it)."""
    root = tmp_path / "run"
    _write(root)
    _fifo_instead_of(_folder(root, 1) / mf.MANIFEST)
    state = _state()
    with Checkpointer(str(root), state, every=1, keep=1) as ck:
        ck.restore()
        ck.step().result()  # type: ignore[union-attr]
    names = sorted(p.name for p in root.iterdir())
    assert names == [mf.step_dir(1), mf.step_dir(STEPS + 1)]  # damaged 1 kept, newest kept
    assert (_folder(root, 1) / mf.MANIFEST).is_fifo()


# -- symbolic links -------------------------------------------------------------------------------
def test_a_chunk_file_linked_outside_the_root_is_refused_without_telling_its_size(ckpt, tmp_path):
    root, saved = ckpt
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 12345)
    (_folder(root, 3) / CHUNKS).unlink()
    (_folder(root, 3) / CHUNKS).symlink_to(secret)
    r = run_cli("verify", str(root), "--step", "3")
    assert r.returncode == 1
    assert f"{CHUNKS} is a symbolic link, not a file; refusing to follow it" in r.stdout
    assert "12345" not in r.stdout + r.stderr  # "truncated: ends at byte 12345" leaked it
    with pytest.warns(UserWarning, match="falling back"):
        _assert_restores(root, 2, saved)
    assert secret.read_bytes() == b"s" * 12345


def test_gc_never_deletes_through_a_step_folder_linked_to_another_run(ckpt, tmp_path):
    root, _ = ckpt
    other = tmp_path / "other"
    _write(other)
    victim = _folder(other, 1)
    before = sorted(p.name for p in victim.iterdir())
    # An old step number of this root, pointing at another run's committed step.
    (root / mf.step_dir(0)).symlink_to(victim, target_is_directory=True)
    cat = scan(Storage(str(root)))
    assert cat.foreign == {mf.step_dir(0): "a symbolic link, not a folder"}
    assert sorted(cat.folders) == [1, 2, 3]
    r = run_cli("gc", str(root), "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert "deleted step 1 (full" in r.stdout and "deleted step 2 (full" in r.stdout
    assert "left 1 foreign entry alone" in r.stdout
    assert sorted(p.name for p in victim.iterdir()) == before  # MANIFEST.json still there
    assert sorted(p.name for p in root.iterdir()) == [mf.step_dir(0), mf.step_dir(3)]
    assert (root / mf.step_dir(0)).is_symlink()


def test_the_storage_layer_never_deletes_through_a_link(tmp_path):
    root, outside = tmp_path / "run", tmp_path / "outside"
    (outside / "step").mkdir(parents=True)
    (outside / "step" / "MANIFEST.json").write_text("{}")
    root.mkdir()
    (root / "step-000000007").symlink_to(outside / "step", target_is_directory=True)
    storage = Storage(str(root))
    with pytest.raises(StorageError, match="leads outside the checkpoint root"):
        storage.delete("step-000000007/MANIFEST.json")
    storage.delete("step-000000007")  # the link goes, not what it points at
    assert not (root / "step-000000007").exists()
    assert (outside / "step" / "MANIFEST.json").read_text() == "{}"


def test_a_writer_never_writes_through_a_planted_step_link(ckpt, tmp_path):
    root, _ = ckpt
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / mf.step_dir(STEPS + 1)).symlink_to(outside, target_is_directory=True)
    storage = Storage(str(root))
    with pytest.raises(StorageError, match="leads outside the checkpoint root"):
        storage.put(f"{mf.step_dir(STEPS + 1)}/{mf.MANIFEST}", [b"{}"])
    assert list(outside.iterdir()) == []


# -- look-alike names -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-000000099", 99),
        ("step-1000000000", 1_000_000_000),
        ("step-0000000099", None),  # ten digits for a nine-digit step
        ("step-00000099", None),  # too short
        ("step-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669", None),  # Arabic-Indic
        ("step-000000099\n", None),
        ("step-000000099 ", None),
        ("step-+00000099", None),
        ("xstep-000000099", None),
    ],
)
def test_only_the_names_the_writer_writes_are_steps(name, step):
    # parse_step_dir also says the timeline (tests/test_timeline.py has the .tK names).
    assert mf.parse_step_dir(name) == (None if step is None else mf.StepFolder(step, 0))
    if step is not None:
        assert mf.step_dir(step) == name


ROGUES = ["step-0000000003", "step-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669"]


def _plant_rogues(root: Path) -> None:
    for name in ROGUES:
        (root / name).mkdir()
        (root / name / mf.MANIFEST).write_bytes((_folder(root, 3) / mf.MANIFEST).read_bytes())


def test_gc_keep_1_keeps_the_newest_real_step_and_leaves_look_alikes(ckpt):
    root, saved = ckpt
    _plant_rogues(root)
    r = run_cli("ls", str(root), "--all")
    assert r.returncode == 0
    assert "2 foreign entries, not checkpoints" in r.stdout
    assert "step-0000000003" in r.stdout and "not a step folder name" in r.stdout
    r = run_cli("gc", str(root), "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert "kept 1 checkpoint(s): 3" in r.stdout and "left 2 foreign entries alone" in r.stdout
    assert sorted(p.name for p in root.iterdir()) == sorted([mf.step_dir(3), *ROGUES])
    _assert_restores(root, 3, saved)


def test_checkpointer_keep_1_beside_look_alikes_keeps_what_it_committed(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    for name in ROGUES:
        (root / name).mkdir()
    state = _state()
    with Checkpointer(str(root), state, every=1, keep=1) as ck:
        for _ in range(3):
            ck.step().result()  # type: ignore[union-attr]
    assert sorted(p.name for p in root.iterdir()) == sorted([mf.step_dir(3), *ROGUES])


# -- the environment is input too -----------------------------------------------------------------
def test_a_knob_that_is_not_a_number_is_one_line_naming_it(ckpt):
    root, _ = ckpt
    env = {**os.environ, "CHECKFLOW_MAX_MANIFEST_BYTES": "64MiB"}
    r = subprocess.run(
        [sys.executable, "-m", "checkflow.cli", "ls", str(root)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert r.returncode == 2
    assert one_line_error(r) == (
        "CHECKFLOW_MAX_MANIFEST_BYTES='64MiB' is not a whole number; "
        "unset it for the default (67108864) or give one"
    )
