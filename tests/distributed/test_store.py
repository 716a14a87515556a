"""What checkflow leaves in the job's c10d store (a real TCPStore, hosted by the launcher)."""

from __future__ import annotations

import pytest
from torch.distributed import TCPStore

from checkflow import list_checkpoints
from tests.distributed._launch import job_store, run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    # The XLA lane runs these on torch 2.9, whose TCPStore cannot list its keys.
    pytest.mark.skipif(
        not hasattr(TCPStore, "list_keys"), reason="torch 2.9's TCPStore has no list_keys"
    ),
]


def _keys_after_training(tmp_path, steps: int) -> list[str]:
    store = job_store()
    uri = tmp_path / f"run-{steps}"
    cfg = {"scenario": "train", "kind": "ddp", "steps": steps, "every": 2, "wait": True}
    run_ranks(2, {**cfg, "uri": str(uri)}, store=store)
    assert [c.step for c in list_checkpoints(str(uri))] == list(range(2, steps + 1, 2))
    return sorted(store.list_keys())


def test_store_keys_stay_bounded_however_many_checkpoints_a_job_commits(tmp_path):
    short = _keys_after_training(tmp_path, 8)  # 4 checkpoints
    long = _keys_after_training(tmp_path, 24)  # 12 checkpoints
    assert not [k for k in long if "/persisted/" in k], long
    assert len(long) == len(short), (short, long)
    checkflow_keys = [k for k in long if "/checkflow/" in k]
    # generation, one holdings record, the two newest agreement rounds of each rank, and
    # rank 0's newest decision (whether the first persist after a restore rolls back).
    assert len(checkflow_keys) == 1 + 1 + 2 * 2 + 1, checkflow_keys


def test_a_restore_leaves_no_agreement_keys_in_the_store(tmp_path):
    uri = tmp_path / "run"
    train = {"scenario": "train", "kind": "ddp", "steps": 4, "every": 2, "wait": True}
    run_ranks(2, {**train, "uri": str(uri)})
    store = job_store()
    run_ranks(2, {"scenario": "restore", "kind": "ddp", "uri": str(uri)}, store=store)
    keys = store.list_keys()
    assert not [k for k in keys if "/restore/" in k], keys
    assert [k for k in keys if "/checkflow/" in k] == [k for k in keys if k.endswith("generation")]
