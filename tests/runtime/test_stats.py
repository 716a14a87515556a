"""One stats record: the training thread and the persist thread count into the same object."""

from __future__ import annotations

import pytest

from checkflow import Checkpointer, list_checkpoints
from checkflow.manifest import step_dir
from tests.runtime._models import small_state, train_step


def test_persists_that_fail_and_commit_are_counted_in_ckpt_stats(tmp_path):
    # A file where step 1's folder must go: its persist fails for real, step 2's commits.
    (tmp_path / step_dir(1)).write_text("not a folder")
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1, keep=0) as ck:
        assert ck.stats is ck._persist.stats
        train_step(state)
        failed = ck.step()
        with pytest.raises(OSError, match="File exists"):
            failed.result(timeout=60)
        with pytest.raises(OSError):  # wait() re-raises the failed persist, once
            ck.wait()
        train_step(state)
        assert ck.step().result(timeout=60) == 2
        stats = ck.stats
        assert (stats.due, stats.taken, stats.failed, stats.committed) == (2, 2, 1, 1)
        assert stats.last_step == 2
        assert stats.bytes_written == stats.last_bytes > 0
        assert stats.last_kind == "full" and len(stats.persist_times) == 1
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2]
