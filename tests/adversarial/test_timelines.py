"""Rollback timelines (issue 30): after a restore to an older step, the steps taken again get
folders of their own, so no kill can leave a step that mixes two timelines.

Real gloo ranks (``tests/distributed/_launch.py``), a real SIGKILL inside the persist of a
re-taken step, real ``checkflow`` CLI processes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from checkflow import Checkpointer, list_checkpoints, load
from checkflow import manifest as mf
from checkflow.catalog import scan
from checkflow.storage import Storage
from tests.cli.test_commands import run_cli, table_rows
from tests.distributed._launch import run_ranks
from tests.runtime._train import assert_bitwise_equal, load_final

SHIFT = 100
"""The new timeline trains on other batches (a rollback past a loss spike skips data)."""


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _restored(outputs: list[str]) -> list[int]:
    return [
        json.loads(line)["restored"]
        for out in outputs
        for line in out.splitlines()
        if line.startswith('{"restored"')
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_mid_persist_of_a_retaken_step_mixes_no_timelines(tmp_path: Path) -> None:
    base = {"scenario": "train", "kind": "ddp", "every": 1, "wait": True}
    first = tmp_path / "first"
    run_ranks(2, {**base, "steps": 3, "uri": str(first)})  # steps 1, 2, 3 on timeline 0
    before = {s: _digests(first / mf.step_dir(s)) for s in (1, 2, 3)}
    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(first, ref)
    shutil.copytree(first, run)
    # Roll back to step 1 and train on other data: the uninterrupted current timeline.
    rollback = {**base, "steps": 4, "restore_step": 1, "data_shift": SHIFT}
    run_ranks(2, {**rollback, "uri": str(ref), "out": str(tmp_path / "ref.pt")})

    # The same rollback, with rank 1 SIGKILLed while both ranks hold step 2 between their
    # rank manifests and the commit: step 2 exists on the abandoned timeline.
    killed = {**rollback, "uri": str(run), "kill": {"rank": 1, "after_step": 2, "delay": 0.3}}
    run_ranks(2, killed, env={"CHECKFLOW_TEST_COMMIT_DELAY_S": "1.5"}, expect_killed=True)
    assert (run / "TIMELINE-1.json").read_bytes() == b'{"forked_at":1,"parent":0,"timeline":1}'
    assert [c.step for c in list_checkpoints(str(run))] == [1]  # 2 and 3 are abandoned
    partial = run / mf.step_dir(2, 1)
    assert (partial / mf.rank_manifest_name(0)).exists() and not (partial / mf.MANIFEST).exists()

    resumed = {**base, "steps": 4, "data_shift": SHIFT, "uri": str(run)}
    outs = run_ranks(2, {**resumed, "out": str(tmp_path / "final.pt")})
    assert _restored(outs) == [1, 1]  # the newest step of the current lineage
    assert_bitwise_equal(load_final(tmp_path / "final.pt"), load_final(tmp_path / "ref.pt"))
    # No folder mixes two timelines: timeline 0's steps are as the first run left them.
    assert {s: _digests(run / mf.step_dir(s)) for s in (1, 2, 3)} == before
    cat = scan(Storage(str(run)))
    assert cat.names == {s: mf.step_dir(s, 0 if s == 1 else 1) for s in (1, 2, 3, 4)}
    assert cat.abandoned == {mf.step_dir(2): "committed", mf.step_dir(3): "committed"}
    assert sorted(p.name for p in run.glob("TIMELINE-*")) == ["TIMELINE-1.json"]  # no 2nd fork
    ours, theirs = load(str(run)), load(str(ref))
    assert_bitwise_equal(ours["model"], theirs["model"])
    assert_bitwise_equal(ours["optim"], theirs["optim"])


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _train(root: Path, steps: int, *, restore: int | None = None, scale: float = 1.0) -> None:
    """One process: restore (``restore``, or the newest), then train to ``steps``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(
        str(root), {"model": model, "optim": opt}, every=1, keep=0, rng=False
    ) as ckpt:
        for _ in range(ckpt.restore(restore), steps):
            model(torch.full((2, 4), scale)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()


@pytest.fixture
def rolled_back(tmp_path: Path) -> Path:
    """Steps 1..3 on timeline 0, a rollback to 1, and steps 2..3 again on timeline 1."""
    root = tmp_path / "run"
    _train(root, 3)
    _train(root, 3, restore=1, scale=-1.0)
    return root


def test_a_rollback_writes_its_own_folders_and_readers_take_the_current_timeline(
    rolled_back: Path, tmp_path: Path
) -> None:
    ref = tmp_path / "ref"
    _train(ref, 1)
    _train(ref, 3, scale=-1.0)  # the current timeline, uninterrupted: 1, then 2..3 at -1
    assert sorted(p.name for p in rolled_back.iterdir()) == [
        "TIMELINE-1.json",
        mf.step_dir(1),
        mf.step_dir(2),
        mf.step_dir(2, 1),
        mf.step_dir(3),
        mf.step_dir(3, 1),
    ]
    assert_bitwise_equal(load(str(rolled_back)), load(str(ref)))
    assert_bitwise_equal(load(str(rolled_back), 2), load(str(ref), 2))


def test_ls_all_marks_the_abandoned_folders_and_json_names_them(rolled_back: Path) -> None:
    plain = run_cli("ls", str(rolled_back))
    assert plain.returncode == 0, plain.stderr
    assert [r[:2] for r in table_rows(plain.stdout, "STEP")] == [
        ["1", "full"],
        ["2", "full"],
        ["3", "full"],
    ]
    assert "2 step folder(s) of rolled-back timelines" in plain.stdout
    listed = run_cli("ls", str(rolled_back), "--all")
    assert [r[:3] for r in table_rows(listed.stdout, "STEP")] == [
        ["1", "full", "-"],
        ["2", "full", "-"],
        ["2", "abandoned", "-"],
        ["3", "full", "-"],
        ["3", "abandoned", "-"],
    ]
    assert f"{mf.step_dir(2)} (committed), {mf.step_dir(3)} (committed)" in listed.stdout
    as_json = json.loads(run_cli("ls", str(rolled_back), "--json").stdout)
    assert as_json["timeline"] == 1
    assert as_json["abandoned"] == {mf.step_dir(2): "committed", mf.step_dir(3): "committed"}
    assert [c["step"] for c in as_json["checkpoints"]] == [1, 2, 3]


def test_gc_deletes_abandoned_folders_and_keeps_the_current_lineage(rolled_back: Path) -> None:
    res = run_cli("gc", str(rolled_back), "--keep", "3")
    assert res.returncode == 0, res.stderr
    assert f"deleted {mf.step_dir(2)} (a rolled-back timeline's)" in res.stdout
    assert sorted(p.name for p in rolled_back.iterdir()) == [
        "TIMELINE-1.json",
        mf.step_dir(1),
        mf.step_dir(2, 1),
        mf.step_dir(3, 1),
    ]
    assert [c.step for c in list_checkpoints(str(rolled_back))] == [1, 2, 3]


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[" * 100_000, b'{"timeline": 1, "parent": 1, "forked_at": 1}', b" " * 8000],
    ids=["bad-json", "deep", "own-parent", "huge"],
)
def test_a_damaged_timeline_file_is_reported_and_ignored_and_gc_deletes_nothing(
    rolled_back: Path, content: bytes
) -> None:
    (rolled_back / "TIMELINE-1.json").write_bytes(content)
    # Timeline 0 is the lineage again; which steps are the run's is unsure: gc keeps all.
    assert [c.step for c in list_checkpoints(str(rolled_back))] == [1, 2, 3]
    listed = run_cli("ls", str(rolled_back))
    assert listed.returncode == 0, listed.stderr
    assert "note: timeline 1 is ignored: TIMELINE-1.json: " in listed.stdout
    before = sorted(p.name for p in rolled_back.iterdir())
    gc = run_cli("gc", str(rolled_back), "--keep", "1")
    assert gc.returncode == 0, gc.stderr
    assert "deleted nothing: TIMELINE-1.json cannot be used" in gc.stdout
    assert sorted(p.name for p in rolled_back.iterdir()) == before


def test_a_second_rollback_forks_from_the_current_timeline(rolled_back: Path) -> None:
    _train(rolled_back, 3, restore=2, scale=2.0)  # step 2 of timeline 1
    assert json.loads((rolled_back / "TIMELINE-2.json").read_bytes()) == {
        "timeline": 2,
        "parent": 1,
        "forked_at": 2,
    }
    cat = scan(Storage(str(rolled_back)))
    assert cat.names == {1: mf.step_dir(1), 2: mf.step_dir(2, 1), 3: mf.step_dir(3, 2)}
    assert sorted(cat.abandoned) == [mf.step_dir(2), mf.step_dir(3), mf.step_dir(3, 1)]


def test_restoring_the_newest_step_starts_no_timeline_and_never_rewrites_a_commit(
    rolled_back: Path,
) -> None:
    _train(rolled_back, 4)  # restores 3 (timeline 1), the newest: goes on on timeline 1
    assert sorted(p.name for p in rolled_back.glob("TIMELINE-*")) == ["TIMELINE-1.json"]
    assert scan(Storage(str(rolled_back))).names[4] == mf.step_dir(4, 1)
    # A fresh run that does not restore reaches step 4, which is committed.
    with (
        pytest.raises(FileExistsError, match="never written again"),
        Checkpointer(str(rolled_back), {"model": _model()}, every=4) as ckpt,
    ):
        for _ in range(4):
            ckpt.step()
