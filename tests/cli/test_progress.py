"""The rich progress bar of verify/restore (in-process, on a string stream)."""

from __future__ import annotations

import io

import pytest

from checkflow.cli.progress import ByteProgress, progress_wanted


def test_progress_bar_counts_bytes_and_grows_its_total() -> None:
    stream = io.StringIO()
    with ByteProgress(1000, "read", stream=stream, enabled=True) as bar:
        bar(600)
        bar(600)  # more than the estimate: a delta chain re-read its base
    assert bar.total == 1200 and bar.done == 1200
    final = stream.getvalue().split("\r")[-1]
    assert "read" in final and "100%" in final and "1.2/1.2 KiB" in final
    assert "\x1b[3" not in stream.getvalue()  # forced onto a non-terminal: no colour codes
    quiet = io.StringIO()
    with ByteProgress(10, "read", stream=quiet) as bar:  # StringIO is not a TTY
        bar(10)
    assert quiet.getvalue() == "" and bar.done == 10


@pytest.mark.parametrize(("env", "wanted"), [("1", True), ("off", False), ("", False)])
def test_progress_env_decides_unless_forced(
    monkeypatch: pytest.MonkeyPatch, env: str, wanted: bool
) -> None:
    monkeypatch.setenv("CHECKFLOW_PROGRESS", env)
    assert progress_wanted(io.StringIO()) is wanted
    assert progress_wanted(io.StringIO(), force=not wanted) is (not wanted)
