"""Reading a checkpoint never runs code from it unless the reader opts in with trust.

The attack: whoever can write a checkpoint can write its manifest too, so the checksums
prove nothing. These tests replace a real checkpoint's stored objects by pickles that create
a canary file when unpickled, with the byte range and xxh3 checksum in the rank manifest
fixed to match, then run every CLI verb, ``load()`` and ``Checkpointer.restore()`` on it.
"""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from checkflow import Checkpointer, list_checkpoints, load, objects
from checkflow import manifest as mf
from checkflow.cli import main
from checkflow.restore import CheckpointReader, CorruptCheckpointError, UntrustedCheckpointError
from checkflow.storage import Storage
from tests.runtime._models import small_state, train_step
from tests.runtime._train import assert_bitwise_equal

STEPS = 2


class Canary:
    """Unpickling it creates ``path``: the evidence that code from the checkpoint ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.path,))


def save_run(root: Path, **kwargs: Any) -> dict[str, Any]:
    state = small_state()
    with Checkpointer(str(root), state, every=1, keep=0, **kwargs) as ck:
        for _ in range(STEPS):
            train_step(state)
            future = ck.step()
            assert future is not None
            future.result()
    return state


def object_entry(root: Path, step: int) -> tuple[Path, dict[str, Any]]:
    path = root / mf.step_dir(step) / mf.rank_manifest_name(0)
    return path, json.loads(path.read_bytes())


def stored_skeleton(root: Path, step: int) -> Any:
    return CheckpointReader(Storage(str(root))).skeleton(step)


def replace_objects(root: Path, step: int, payload: bytes, encoding: str | None) -> None:
    """What an attacker does: new object bytes, with a byte range and checksum that match.

    ``encoding=None`` drops the field, as in checkpoints written before it existed."""
    path, raw = object_entry(root, step)
    entry = raw["objects"][0]
    data = root / mf.step_dir(step) / entry["file"]
    offset = data.stat().st_size
    with data.open("ab") as f:
        f.write(payload)
    entry.update(byte_offset=offset, nbytes=len(payload))
    entry["checksum"] = xxhash.xxh3_64_hexdigest(payload)
    if encoding is None:
        entry.pop("encoding", None)
    else:
        entry["encoding"] = encoding
    path.write_bytes(json.dumps(raw).encode())


def torch_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def craft(root: Path, canary: Path, how: str) -> None:
    """Every step of ``root`` gets malicious objects; the real ones stay inside, so that
    a trusting reader restores the run (and creates the canary)."""
    for step in range(1, STEPS + 1):
        evil = {**stored_skeleton(root, step), "evil": Canary(canary)}
        if how == "legacy":  # a format-1 checkpoint from before objects were data
            replace_objects(root, step, torch_pickle(evil), None)
        elif how == "pickle-node":  # a pickle inside the tree, as allow_pickle writes
            replace_objects(root, step, objects.encode(evil, allow_pickle=True), mf.OBJECTS_TREE)
        else:  # a pickle labelled as a tree: the label decides, and JSON never unpickles
            assert how == "mislabelled"
            replace_objects(root, step, torch_pickle(evil), mf.OBJECTS_TREE)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("safe") / "run"
    state = save_run(root)
    return root, {k: v.state_dict() for k, v in state.items()}


@pytest.fixture(params=["legacy", "pickle-node", "mislabelled"])
def crafted(request: Any, clean_run: Any, tmp_path: Path) -> tuple[Path, Path, str]:
    import shutil

    root = tmp_path / "run"
    shutil.copytree(clean_run[0], root)
    canary = tmp_path / "canary"
    craft(root, canary, request.param)
    return root, canary, request.param


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- every CLI verb -----------------------------------------------------------------------------
def test_no_cli_verb_runs_a_crafted_pickle_and_restore_says_how_to_opt_in(
    crafted: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, canary, how = crafted
    uri = str(root)
    bad = how == "mislabelled"  # not a tree: damaged, whatever the trust

    code, out, _ = cli(capsys, "ls", uri)
    assert code == 0 and "2  full" in out

    code, out, err = cli(capsys, "inspect", uri)
    if bad:
        assert code == 1 and "objects: unreadable" in out and "not valid JSON" in out
    else:
        assert code == 0, err
        shown = "all objects (older checkflow)" if how == "legacy" else "Canary>"
        assert "-byte pickle of" in out and shown in out
    code, out, _ = cli(capsys, "inspect", uri, "--json")
    assert code == (1 if bad else 0) and json.loads(out)["step"] == 2

    code, out, _ = cli(capsys, "verify", uri, "--all")
    assert code == (1 if bad else 0), out

    target = tmp_path / "out.pt"
    code, _, err = cli(capsys, "restore", uri, "--out", str(target))
    if bad:
        assert code == 1 and "damaged" in err
    else:
        assert code == 2 and "--trust" in err and "unpickling runs code" in err
        assert len(err.strip().splitlines()) == 1
    assert not target.exists()
    code, _, err = cli(capsys, "restore", uri, "--out", str(tmp_path / "dcp"), "--format", "dcp")
    assert code == (1 if bad else 2) and ("--trust" in err or bad)
    # safetensors holds the tensors and a description of the objects: nothing to unpickle.
    code, _, err = cli(
        capsys, "restore", uri, "--out", str(tmp_path / "w.st"), "--format", "safetensors"
    )
    assert code == (1 if bad else 0), err

    code, out, _ = cli(capsys, "gc", uri, "--keep", "1", "--dry-run")
    assert code == 0 and "would delete step 1" in out
    assert not canary.exists()

    code, _, err = cli(capsys, "restore", uri, "--out", str(target), "--trust")
    if bad:
        assert code == 1 and not canary.exists()
    else:
        assert code == 0, err
        assert canary.exists()  # the opt-in unpickles: the refusals above were real
        restored = torch.load(target, weights_only=False)
        assert restored["model"].keys() == small_state()["model"].state_dict().keys()


def test_the_installed_command_refuses_a_legacy_pickle_then_runs_it_with_trust(
    clean_run: Any, tmp_path: Path
) -> None:
    import shutil

    root, canary, out = tmp_path / "run", tmp_path / "canary", tmp_path / "out.pt"
    shutil.copytree(clean_run[0], root)
    craft(root, canary, "legacy")
    command = [sys.executable, "-m", "checkflow.cli", "restore", str(root), "--out", str(out)]

    refused = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert refused.returncode == 2 and not canary.exists() and not out.exists()
    assert refused.stderr.startswith("checkflow: error: step 2 in ")
    assert "written by a checkflow that stored the non-tensor state" in refused.stderr
    assert "--trust to 'checkflow restore'" in refused.stderr

    trusted = subprocess.run([*command, "--trust"], capture_output=True, text=True, timeout=180)
    assert trusted.returncode == 0, trusted.stderr
    assert canary.exists() and out.exists()


# -- load() and Checkpointer.restore() ------------------------------------------------------------
def test_load_and_restore_refuse_a_crafted_pickle_and_run_it_only_with_trust(
    crafted: tuple[Path, Path, str], clean_run: Any
) -> None:
    root, canary, how = crafted
    fresh = small_state(seed=1)
    untouched = {k: v.clone() for k, v in fresh["model"].state_dict().items()}

    if how == "mislabelled":
        with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
            load(str(root), trust=True)
        with (
            pytest.warns(UserWarning, match="cannot be restored|could be restored"),
            Checkpointer(str(root), fresh) as ck,
        ):
            assert ck.restore(trust=True) == 0
        assert not canary.exists()
        return

    with pytest.raises(UntrustedCheckpointError, match=r"pass trust=True to load\(\)"):
        load(str(root))
    with Checkpointer(str(root), fresh) as ck, pytest.raises(UntrustedCheckpointError):
        ck.restore()
    assert not canary.exists()
    assert_bitwise_equal(untouched, fresh["model"].state_dict(), "model (not restored)")

    assert load(str(root), trust=True)["__checkflow__"]["step"] == STEPS
    assert canary.exists()
    canary.unlink()
    with Checkpointer(str(root), fresh) as ck:
        assert ck.restore(trust=True) == STEPS
    assert canary.exists()
    assert_bitwise_equal(clean_run[1]["model"], fresh["model"].state_dict(), "model")


# -- allow_pickle ---------------------------------------------------------------------------------
class Tagged:
    """State whose state_dict holds a set: not data checkflow stores without pickle."""

    def __init__(self) -> None:
        self.tags = {"warmup", "eval"}

    def state_dict(self) -> dict[str, Any]:
        return {"tags": self.tags, "n": len(self.tags)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.tags = set(sd["tags"])


def test_state_that_is_not_data_is_refused_at_save_unless_allow_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {**small_state(), "extra": Tagged()}
    with Checkpointer(str(tmp_path / "refused"), state, every=1) as ck:
        train_step(state)
        with pytest.raises(TypeError) as err:
            ck.step()
    message = str(err.value)
    assert message.startswith("cannot store state 'extra.tags' of type set:")
    assert "allow_pickle=True" in message and "\n" not in message
    assert list_checkpoints(str(tmp_path / "refused")) == []

    uri = str(tmp_path / "allowed")
    with Checkpointer(uri, state, every=1, allow_pickle=True) as ck:
        ck.save().result()
    with pytest.raises(UntrustedCheckpointError, match=r"'extra\.tags' \(set\).*allow_pickle"):
        load(uri)
    assert load(uri, trust=True)["extra"] == {"tags": {"warmup", "eval"}, "n": 2}
    code, out, _ = cli(capsys, "inspect", uri)
    assert code == 0 and "-byte pickle of set>" in out

    other = {**small_state(seed=3), "extra": Tagged()}
    other["extra"].tags = set()
    with Checkpointer(uri, other, allow_pickle=True) as ck:
        with pytest.raises(UntrustedCheckpointError):
            ck.restore()
        assert ck.restore(trust=True) == 0  # saved before any step() was counted
    assert other["extra"].tags == {"warmup", "eval"}


# -- checkpoints written before objects were data -----------------------------------------------
def test_an_older_checkpoint_loads_only_with_trust_and_resaving_it_stores_data(
    clean_run: Any, tmp_path: Path
) -> None:
    import shutil

    root = tmp_path / "old"
    shutil.copytree(clean_run[0], root)
    for step in range(1, STEPS + 1):  # what the previous writer stored: torch.save
        replace_objects(root, step, torch_pickle(stored_skeleton(root, step)), None)

    with pytest.raises(UntrustedCheckpointError, match="written by a checkflow that stored"):
        load(str(root))
    # Equal stored trees are bit-exact equal states (numpy RNG state included).
    assert objects.encode(load(str(root), trust=True)) == objects.encode(load(str(clean_run[0])))

    state = small_state(seed=5)
    with Checkpointer(str(root), state, every=1, keep=0) as ck:
        assert ck.restore(trust=True) == STEPS
        train_step(state)
        ck.step().result()  # type: ignore[union-attr]
    _, raw = object_entry(root, STEPS + 1)
    assert raw["objects"][0]["encoding"] == mf.OBJECTS_TREE
    assert_bitwise_equal(state["model"].state_dict(), load(str(root))["model"], "model")


# -- cross-rank records ---------------------------------------------------------------------------
def test_rank_records_cross_the_store_as_json_not_pickle(tmp_path: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from checkflow.distributed import LocalState, RankSync

    store = dist.FileStore(str(tmp_path / "store"), 1)
    store.set_timeout(timedelta(seconds=20))  # a missing key fails fast
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sync = RankSync(dist.group.WORLD, "memory://run")
        local = LocalState(replicated={"model.w": torch.zeros(4)})
        agreed = sync.agree(busy=False, interval=7, local=local)
        raw = sync.store  # the job's store, under this checkpointer's prefix
        record = json.loads(raw.get("round/1/0"))
        assert record[:2] == [False, 7] and record[3] == 0
        assert json.loads(raw.get(f"holdings/{record[2]}")) == {"model.w": 16}
        assert agreed.go and agreed.interval == 7 and agreed.writers == {"model.w": 0}
    finally:
        dist.destroy_process_group()
