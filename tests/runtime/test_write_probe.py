"""A root that cannot take checkpoints fails at open, and persist failures say what they are.

Before: ``Checkpointer("/proc/x", ...)`` trained 100 steps with 0 checkpoints committed, its
log saying "storage is slower than the checkpoint interval", and raised only when the
``with`` block ended. Now ``open()`` writes and deletes a probe file in the root and raises
at once naming the root and the reason; a persist that fails later is a "storage error",
counted in ``stats.failed``, never logged as a slow store.

The roots are real unwritable places: ``/proc`` (no folder can be made there, even by
root, which CI runs as) and a path under an existing file; the S3 cases go through a real
HTTP proxy in front of moto that answers the chosen requests with errors.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow import Checkpointer
from checkflow.storage import StorageAccessError, StorageError
from checkflow.storage.probe import PROBE_PREFIX
from tests.runtime._models import small_state, train_step
from tests.support.paths import EXAMPLES, REPO
from tests.support.s3 import FaultyS3Proxy, S3Location


def _under_a_file(tmp_path: Path) -> str:
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    return str(tmp_path / "notes.txt" / "ckpt")


def test_train_py_on_proc_stops_before_the_first_step_naming_the_root_and_why():
    """The journey of the issue, as a user runs it: no step is trained unprotected."""
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py"), "--dir", "/proc/x", "--steps", "100"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert res.returncode == 1
    assert res.stdout == ""  # not "start step 0", not one "step N loss"
    last = res.stderr.strip().splitlines()[-1]
    assert last == (
        "checkflow.storage.errors.StorageError: cannot write checkpoints to /proc/x: "
        "[Errno 2] No such file or directory: '/proc/x'; pick a writable folder "
        "(or a store and credentials that may write there)"
    )
    assert "slower" not in res.stderr


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        (lambda tmp: "/proc/x", "[Errno 2] No such file or directory: '/proc/x'"),
        (_under_a_file, "[Errno 20] Not a directory: '{root}'"),
    ],
    ids=["proc", "under-a-file"],
)
def test_open_raises_at_once_with_the_root_and_the_reason(tmp_path, where, reason):
    root = where(tmp_path)
    ck = Checkpointer(root, small_state(), every=1)
    with pytest.raises(StorageError) as raised:
        ck.open()
    assert str(raised.value) == (
        f"cannot write checkpoints to {root}: {reason.format(root=root)}; pick a writable "
        "folder (or a store and credentials that may write there)"
    )
    assert not ck._opened  # no thread was started: nothing to close
    ck.close()  # a no-op, as for a Checkpointer never opened


def test_a_good_local_root_is_created_and_keeps_no_probe_file(tmp_path):
    root = tmp_path / "run"
    state = small_state()
    with Checkpointer(str(root), state, every=2) as ck:
        assert sorted(os.listdir(root)) == []  # made by the probe, which is gone again
        for _ in range(2):
            train_step(state)
            ck.step()
    assert sorted(os.listdir(root)) == ["step-000000002"]


def test_a_probe_refused_by_s3_is_an_access_error_naming_the_root(
    s3_fault_proxy: FaultyS3Proxy, faulty_s3: S3Location
):
    s3_fault_proxy.fail("PUT", times=1, status=403)
    ck = Checkpointer(faulty_s3.uri, small_state(), storage_options=faulty_s3.storage_options)
    with pytest.raises(StorageAccessError, match=r"^cannot write checkpoints to s3://") as raised:
        ck.open()
    assert f"under {faulty_s3.uri}" in str(raised.value)  # what to do: credentials that may
    assert "access denied" in str(raised.value)


def test_a_probe_on_s3_leaves_no_object(faulty_s3: S3Location, s3_fault_proxy: FaultyS3Proxy):
    with Checkpointer(faulty_s3.uri, small_state(), storage_options=faulty_s3.storage_options):
        pass
    puts = [path for method, path, _ in s3_fault_proxy.log if method == "PUT"]
    deletes = [p for m, p, _ in s3_fault_proxy.log if m in ("DELETE", "POST")]
    assert len(puts) == 1 and PROBE_PREFIX in puts[0]
    assert deletes, "the probe object is deleted again"
    from checkflow.storage import Storage

    store = Storage(faulty_s3.uri, storage_options=faulty_s3.storage_options)
    assert store.listdir() == []


def test_persists_failing_after_open_are_storage_errors_never_a_slow_store(tmp_path, caplog):
    """The root goes away after the probe (a folder replaced by a file): each due checkpoint
    fails as a storage error, counted in ``stats.failed``; the end of the block raises it."""
    root = tmp_path / "run"
    state = small_state()
    ck = Checkpointer(str(root), state, every=1, keep=0)
    logs = caplog.at_level(logging.WARNING, logger="checkflow")
    with logs, pytest.raises(NotADirectoryError), ck:  # raised as the block ends
        root.rmdir()
        root.write_text("not a folder any more\n")
        for _ in range(3):
            train_step(state)
            ck.step()
    assert (ck.stats.due, ck.stats.committed, ck.stats.failed) == (3, 0, 3)
    assert ck.stats.last_error.startswith("storage error: [Errno 20] Not a directory")
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [m.split(":")[0] for m in failures] == [
        f"checkpoint of step {s} failed" for s in (1, 2, 3)
    ]
    assert all(": storage error: [Errno 20] Not a directory" in m for m in failures)
    assert not [r for r in caplog.records if "slower" in r.getMessage()]


def test_waiting_for_persists_that_fail_says_they_fail_not_that_storage_is_slow(
    s3_fault_proxy: FaultyS3Proxy, faulty_s3: S3Location, caplog
):
    """Every PUT after the probe answers 500: each persist retries (about 1.5 s) and fails,
    so the due checkpoints after the second wait for a buffer set (a step takes a few ms);
    each wait names the failure that freed its set."""
    state = small_state()
    ck = Checkpointer(
        faulty_s3.uri, state, every=1, keep=0, storage_options=faulty_s3.storage_options
    )
    logs = caplog.at_level(logging.WARNING, logger="checkflow")
    with logs, pytest.raises(StorageError), ck:  # raised as the block ends
        s3_fault_proxy.fail("PUT", times=1000, status=500)
        for _ in range(4):
            train_step(state)
            ck.step()
    assert (ck.stats.due, ck.stats.committed, ck.stats.failed) == (4, 0, 4)
    waits = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert 1 <= ck.stats.waits == len(waits) <= 2  # the 1st and 2nd waits are both logged
    for message in waits:
        assert re.match(
            r"checkpoint at step [34] waited \d+\.\d{3}s for the previous persists, which are "
            r"failing \([1-3] failed so far; the newest: storage error: write s3://",
            message,
        ), message
        assert message.endswith("fix the storage, a larger `every` will not help")
    assert not [r for r in caplog.records if "slower" in r.getMessage()]
