"""Checkpointer behaviour in one process: restore, retention, skips, arguments, storage kinds."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
import torch

from checkflow import Checkpointer, list_checkpoints, load
from checkflow.manifest import MANIFEST, step_dir
from tests.runtime._models import small_state, train_step


def _run(uri, state, steps, **kw):
    with Checkpointer(uri, state, **kw) as ck:
        start = ck.restore()
        for _ in range(start, steps):
            train_step(state)
            ck.step()
            ck.wait()
    return ck


def test_restore_returns_zero_and_changes_nothing_without_checkpoints(tmp_path):
    state = small_state()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with Checkpointer(str(tmp_path), state, every=1) as ck:
        assert ck.restore() == 0
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, before[k])


def test_restore_brings_back_the_newest_committed_step_into_fresh_objects(tmp_path):
    state = small_state()
    _run(str(tmp_path), state, 5, every=2)
    fresh = small_state(seed=7)
    with Checkpointer(str(tmp_path), fresh, every=2) as ck:
        assert ck.restore() == 4
        assert ck.current_step == 4
    saved = load(str(tmp_path))
    for k, v in saved["model"].items():
        assert torch.equal(fresh["model"].state_dict()[k], v)
    assert fresh["sched"].state_dict()["last_epoch"] == 4
    opt_state = fresh["optim"].state_dict()["state"]
    assert float(opt_state[0]["step"]) == 4.0


def test_keep_retains_the_newest_committed_and_deletes_abandoned_partials(tmp_path):
    state = small_state()
    # An abandoned partial folder from a crashed run, older than what will be committed.
    partial = tmp_path / step_dir(1)
    partial.mkdir()
    (partial / "rank-00000-000.chunks").write_bytes(b"x" * 10)
    _run(str(tmp_path), state, 6, every=1, keep=2)
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(5), step_dir(6)]


def test_a_save_resolves_at_its_commit_and_wait_after_deleting_old_steps(tmp_path, monkeypatch):
    from checkflow.write import persist

    deleting, release = threading.Event(), threading.Event()
    real = persist.apply_retention
    calls = []

    def slow_retention(storage, keep):
        calls.append(keep)
        if len(calls) == 2:  # the retention after step 2's commit: step 1 to delete
            deleting.set()
            assert release.wait(30)
        return real(storage, keep)

    monkeypatch.setattr(persist, "apply_retention", slow_retention)
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1000, keep=1) as ck:
        train_step(state)
        ck.step()
        assert ck.save().result(timeout=30) == 1
        train_step(state)
        ck.step()
        # Committed and resolved while the retention it triggered is still held.
        assert ck.save().result(timeout=30) == 2
        assert deleting.wait(30)
        assert [c.step for c in list_checkpoints(str(tmp_path))] == [1, 2]
        threading.Timer(0.2, release.set).start()
        ck.wait()  # waits for the retention too: after it, step 1 is gone
        assert release.is_set()
        assert [c.step for c in list_checkpoints(str(tmp_path))] == [2]


def test_a_failed_retention_is_logged_and_fails_no_checkpoint(tmp_path, monkeypatch, caplog):
    from checkflow.write import persist

    def broken_retention(storage, keep):
        raise RuntimeError("listing refused")

    monkeypatch.setattr(persist, "apply_retention", broken_retention)
    with caplog.at_level(logging.WARNING, logger="checkflow.write.persist"):
        ck = _run(str(tmp_path), small_state(), 3, every=1, keep=1)
    assert ck.stats.failed == 0
    assert ck.stats.retention_failures == 3  # after each commit, counted, never raised
    assert ck.stats.retention_error == "listing refused (retried later)"
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1, 2, 3]
    assert any("listing refused" in r.getMessage() for r in caplog.records)


def test_every_due_checkpoint_is_taken_while_persists_are_slow(tmp_path, monkeypatch):
    # Each persist takes over 1 s while steps take milliseconds: the second snapshot goes
    # into the second buffer set, the later ones wait for a set, and none is skipped.
    monkeypatch.setenv("CHECKFLOW_TEST_COMMIT_DELAY_S", "1.0")
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1, keep=0) as ck:
        for _ in range(4):
            train_step(state)
            ck.step()
        assert ck.stats.due == ck.stats.taken == 4
        assert ck.stats.skipped == 0
        assert ck.stats.waits == 2  # steps 3 and 4 found both sets busy
        assert ck.stats.waited_s > 1.0
        assert ck._snapshotter.buffers.made == 2
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1, 2, 3, 4]
    assert ck.stats.committed == 4


def test_every_n_step_exists_after_wait_even_when_steps_outpace_storage(tmp_path, monkeypatch):
    # The user report: every=2 over 10 fast steps, then wait() after step 8 -> step 8 missing.
    monkeypatch.setenv("CHECKFLOW_TEST_COMMIT_DELAY_S", "0.1")
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=2, keep=0) as ck:
        for _ in range(8):
            train_step(state)
            ck.step()
        ck.wait()
        assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 4, 6, 8]
        saved = load(str(tmp_path), step=8)
        for k, v in state["model"].state_dict().items():
            assert torch.equal(saved["model"][k], v)


def test_waiting_for_a_buffer_set_is_logged_with_its_reason(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CHECKFLOW_TEST_COMMIT_DELAY_S", "1.0")
    state = small_state()
    with (
        caplog.at_level(logging.WARNING, logger="checkflow.checkpointer"),
        Checkpointer(str(tmp_path), state, every=1, keep=1) as ck,
    ):
        for _ in range(3):
            train_step(state)
            ck.step()
    waits = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(waits) == 1  # step 3 waited once; rate-limited to 1, 2, 4, 8... waits
    assert "storage is slower than the checkpoint interval" in waits[0]
    assert "step 3" in waits[0]


def test_when_busy_skip_is_an_explicit_opt_in_that_counts_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKFLOW_TEST_COMMIT_DELAY_S", "1.0")
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1, when_busy="skip", keep=0) as ck:
        for _ in range(4):
            train_step(state)
            ck.step()
        # Two buffer sets: steps 1 and 2 are taken, 3 and 4 find both busy and are skipped.
        assert ck.stats.due == 4
        assert ck.stats.taken == 2
        assert ck.stats.skipped == 2
        assert ck.stats.waits == 0
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1, 2]


def test_when_busy_rejects_an_unknown_value(tmp_path):
    with pytest.raises(ValueError, match="when_busy"):
        Checkpointer(str(tmp_path), small_state(), every=1, when_busy="drop")


def test_a_persist_that_keeps_up_allocates_only_one_buffer_set(tmp_path):
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1, keep=1) as ck:
        for _ in range(4):
            train_step(state)
            ck.step()
            ck.wait()
        assert ck._snapshotter.buffers.made == 1
        assert ck.stats.waits == 0


def test_save_at_an_already_checkpointed_step_returns_that_checkpoint(tmp_path):
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=2, keep=0) as ck:
        for _ in range(2):
            train_step(state)
            ck.step()
        assert ck.save().result(timeout=30) == 2
        assert ck.stats.taken == 1  # no second snapshot of step 2


def test_save_forces_a_checkpoint_and_its_future_resolves_to_the_step(tmp_path):
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1000) as ck:
        for _ in range(3):
            train_step(state)
            ck.step()
        assert ck.save().result(timeout=30) == 3
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [3]


def test_steady_state_allocates_no_new_host_buffers(tmp_path):
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1, keep=1) as ck:
        train_step(state)
        ck.step()
        ck.wait()
        first = ck._snapshotter.buffers.allocations
        for _ in range(5):
            train_step(state)
            ck.step()
            ck.wait()
        assert ck._snapshotter.buffers.allocations == first


def test_memory_uri_round_trips(tmp_path):
    uri = f"memory://checkflow-test/{uuid.uuid4().hex}"
    state = small_state()
    _run(uri, state, 3, every=1)
    assert [c.step for c in list_checkpoints(uri)] == [1, 2, 3]
    for k, v in load(uri)["model"].items():
        assert torch.equal(state["model"].state_dict()[k], v)


@pytest.mark.s3
def test_s3_uri_round_trips_through_moto(s3_uri):
    state = small_state()
    _run(s3_uri.uri, state, 2, every=1, storage_options=s3_uri.storage_options)
    infos = list_checkpoints(s3_uri.uri, storage_options=s3_uri.storage_options)
    assert [c.step for c in infos] == [1, 2]
    saved = load(s3_uri.uri, storage_options=s3_uri.storage_options)
    for k, v in saved["model"].items():
        assert torch.equal(state["model"].state_dict()[k], v)


def test_zstd_codec_is_lossless_and_smaller_on_structured_data(tmp_path):
    state = {"model": torch.nn.Linear(256, 256)}
    with torch.no_grad():
        state["model"].weight.copy_(torch.arange(256 * 256).reshape(256, 256) % 7)
    with Checkpointer(str(tmp_path / "z"), state, every=1, codec="zstd") as ck:
        ck.step()
    with Checkpointer(str(tmp_path / "e"), state, every=1) as ck:
        ck.step()
    z, e = list_checkpoints(str(tmp_path / "z"))[0], list_checkpoints(str(tmp_path / "e"))[0]
    assert z.nbytes < e.nbytes / 4
    assert torch.equal(load(str(tmp_path / "z"))["model"]["weight"], state["model"].weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "every"),
        ({"every": "often"}, "every"),
        ({"keep": -1}, "keep"),
        ({"max_overhead": 0}, "max_overhead"),
        ({"codec": "q3"}, "unknown codec 'q3'.*valid codecs: .*exact"),
        ({"coordinator": "http://127.0.0.1:1"}, "job="),
    ],
)
def test_bad_arguments_are_rejected_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Checkpointer(str(tmp_path / "c"), small_state(), **kwargs)
    assert not (tmp_path / "c").exists()


def test_wrong_uri_protocol_is_a_clear_error(tmp_path):
    from checkflow.storage import StorageError

    with pytest.raises(StorageError, match="nosuchfs"):
        Checkpointer("nosuchfs://bucket/x", small_state(), every=1)


def test_object_without_state_dict_is_rejected():
    with pytest.raises(TypeError, match="state_dict"):
        Checkpointer("/tmp/never", {"model": object()}, every=1)


def test_commit_marker_is_written_last(tmp_path, monkeypatch):
    # While a persist sleeps before its commit, the step folder is present but invisible.
    monkeypatch.setenv("CHECKFLOW_TEST_COMMIT_DELAY_S", "1")
    state = small_state()
    with Checkpointer(str(tmp_path), state, every=1) as ck:
        train_step(state)
        f = ck.step()
        import time

        time.sleep(0.5)
        assert (tmp_path / step_dir(1)).exists()
        assert not (tmp_path / step_dir(1) / MANIFEST).exists()
        assert list_checkpoints(str(tmp_path)) == []
        f.result(timeout=30)
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1]


@pytest.mark.s3
def test_checkpoint_commits_through_an_s3_endpoint_that_fails_some_puts(faulty_s3, s3_fault_proxy):
    state = small_state()
    train_step(state)
    s3_fault_proxy.fail("PUT", times=3, status=503)
    with Checkpointer(
        faulty_s3.uri, state, every=1, storage_options=faulty_s3.storage_options
    ) as ck:
        ck.step()
    failed = [entry for entry in s3_fault_proxy.log if entry[0] == "PUT" and entry[2] == 503]
    assert len(failed) == 3
    infos = list_checkpoints(faulty_s3.uri, storage_options=faulty_s3.storage_options)
    assert [c.step for c in infos] == [1]
    saved = load(faulty_s3.uri, storage_options=faulty_s3.storage_options)
    for k, v in saved["model"].items():
        assert torch.equal(state["model"].state_dict()[k], v)


def test_every_auto_measures_then_picks_and_reports_an_interval(tmp_path, caplog):
    import logging
    import time

    from checkflow.interval import choose_interval

    state = small_state()
    with (
        caplog.at_level(logging.INFO, logger="checkflow"),
        Checkpointer(str(tmp_path), state, every="auto", max_overhead=0.05, keep=1) as ck,
    ):
        deadline = time.monotonic() + 120
        # Until a checkpoint was measured (its persist committed, then a step ran) and the
        # interval was used: with two buffer sets, three snapshots can be taken before the
        # first persist on a loaded machine ends, so "taken" alone says nothing measured.
        while (ck.stats.taken < 3 or ck._tuner.profile is None) and time.monotonic() < deadline:
            train_step(state)
            time.sleep(0.005)  # a step of a few milliseconds, like real work
            ck.step()
    assert ck.stats.taken >= 3  # the warm-up checkpoint, then at the chosen interval
    profile = ck._tuner.profile
    assert profile is not None and profile.iteration_s >= 0.005
    # The interval in use is the policy's choice for a measured profile, and was logged.
    assert ck.stats.interval == ck._tuner.interval >= 1
    logged = [r.getMessage() for r in caplog.records if "checkpoint interval now" in r.getMessage()]
    if ck.stats.interval != 10:  # a change from the warm-up interval is logged with its inputs
        assert logged and f"now {ck.stats.interval} steps" in logged[-1]
        assert "budget 5.0%" in logged[-1]
    p = profile
    assert choose_interval(p, max_overhead=0.05) >= 1


def test_every_auto_measures_a_persist_slower_than_its_warm_up_interval(tmp_path, monkeypatch):
    # Each persist takes over 0.3 s while ten warm-up steps take ~0.05 s: later snapshots are
    # taken while the first persists. The first one must still be measured, and the chosen
    # interval must leave each persist its time (before the fix, every new snapshot replaced
    # the measurement, none completed, and the warm-up interval kept training waiting).
    import time

    from checkflow.interval import PERSIST_HEADROOM

    monkeypatch.setenv("CHECKFLOW_TEST_COMMIT_DELAY_S", "0.3")
    state = small_state()
    with Checkpointer(str(tmp_path), state, every="auto", max_overhead=0.05, keep=1) as ck:
        deadline = time.monotonic() + 60
        while ck._tuner.profile is None and time.monotonic() < deadline:
            train_step(state)
            time.sleep(0.005)
            ck.step()
        profile = ck._tuner.profile
        assert profile is not None, "no checkpoint was ever measured"
        assert profile.persist_s >= 0.3
        interval_s = ck.stats.interval * profile.iteration_s
        assert interval_s >= PERSIST_HEADROOM * profile.persist_s - profile.iteration_s


def test_save_right_after_restore_is_the_restored_checkpoint_and_writes_nothing(tmp_path):
    """A requested checkpoint is a promise, and a committed folder is never written again:
    at the step just restored from storage, ``save()`` is that commit."""
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 4)
    with Checkpointer(str(root), {"model": model}, every=1, keep=0) as ck:
        for _ in range(3):
            ck.step()
        ck.wait()
    before = {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}
    for step in (3, 2):
        with Checkpointer(str(root), {"model": torch.nn.Linear(4, 4)}, every=1, keep=0) as ck:
            assert ck.restore(step=step) == step
            assert ck.save().result(timeout=60) == step
    assert {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")} == before
