"""Retention planning and the catalog of a checkpoint root (no torch needed)."""

from __future__ import annotations

from checkflow.catalog import apply_retention, delete_steps, plan_retention, retention_plan, scan
from checkflow.manifest import MANIFEST, GlobalManifest, step_dir
from checkflow.storage import Storage


def _m(step: int, bases: list[int] | None = None) -> GlobalManifest:
    return GlobalManifest(
        step=step,
        world_size=1,
        created=0.0,
        base_steps=bases or [],
        kind="delta" if bases else "full",
    )


def test_keep_newest_and_every_base_a_kept_delta_needs():
    steps = {1: _m(1), 2: _m(2, [1]), 3: _m(3, [2]), 4: _m(4), 5: _m(5, [4])}
    keep, delete = retention_plan(steps, [1, 2, 3, 4, 5], keep=2)
    assert keep == [4, 5] and delete == [1, 2, 3]
    keep, delete = retention_plan(steps, [1, 2, 3, 4, 5], keep=1)
    assert keep == [4, 5] and delete == [1, 2, 3]  # 5 is a delta on 4
    keep, delete = retention_plan(steps, [1, 2, 3, 4, 5], keep=3)
    assert keep == [1, 2, 3, 4, 5] and delete == []  # 3 needs 2 needs 1


def test_partial_folders_above_the_newest_commit_may_be_in_flight_and_stay():
    steps = {2: _m(2), 4: _m(4)}
    _, delete = retention_plan(steps, [1, 2, 3, 4, 5], keep=1)
    assert delete == [1, 2, 3]


def test_gc_never_deletes_a_step_whose_commit_marker_is_damaged(tmp_path):
    storage = Storage(str(tmp_path))
    for step in (1, 2, 3):
        storage.put(f"{step_dir(step)}/{MANIFEST}", [_m(step).to_json()])
    storage.put(f"{step_dir(2)}/{MANIFEST}", [b"{not json"])
    cat = scan(storage)
    assert sorted(cat.committed) == [1, 3] and list(cat.damaged) == [2]
    assert apply_retention(storage, keep=1) == [1]
    assert (tmp_path / step_dir(2) / MANIFEST).read_bytes() == b"{not json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(2), step_dir(3)]


def test_retention_plan_says_why_each_step_is_kept_or_deleted(tmp_path):
    storage = Storage(str(tmp_path))
    manifests = {1: _m(1), 2: _m(2), 3: _m(3, [2]), 5: _m(5)}
    for step, m in manifests.items():
        storage.put(f"{step_dir(step)}/{MANIFEST}", [m.to_json()])
    storage.put(f"{step_dir(4)}/rank-00000.bin", [b"abandoned"])  # no commit marker
    storage.put(f"{step_dir(6)}/{MANIFEST}", [b"{not json"])

    plan = plan_retention(scan(storage), keep=2)

    assert plan.keep == [2, 3, 5] and plan.needed_bases == [2]
    assert plan.delete == [1, 4] and plan.uncommitted == [4]
    assert list(plan.damaged) == [6]
    assert delete_steps(storage, plan.delete) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(s) for s in (2, 3, 5, 6)]
