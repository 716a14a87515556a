"""What the commands print: tables, times, sizes, errors as exit codes (in-process)."""

from __future__ import annotations

import time

import pytest

from checkflow.cli.output import (
    EXIT_FAILED,
    EXIT_USAGE,
    CliError,
    cell,
    error,
    explain,
    fmt_ago,
    fmt_steps,
    fmt_time,
    human_bytes,
    table,
)


def test_a_table_off_a_terminal_is_plain_aligned_text_without_trailing_spaces(
    capsys: pytest.CaptureFixture[str],
) -> None:
    long = "x" * 300  # wider than any terminal: still one line, not wrapped or cut
    table(["STEP", "KIND", "NOTE"], [[2, "full", None], [150, "delta", long]], right={0})

    out = capsys.readouterr().out
    assert out.splitlines() == [
        "STEP  KIND   NOTE",
        "   2  full   -",
        f" 150  delta  {long}",
    ]


def test_table_cells_print_as_they_are_without_markup_or_emoji(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table(["VALUE"], [["[bold]x[/bold] :smile:"], [0.000123456]])
    assert capsys.readouterr().out.splitlines()[1:] == ["[bold]x[/bold] :smile:", "0.000123"]


def test_times_sizes_and_steps_format_for_people() -> None:
    now = time.time()
    assert fmt_time(now) == time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    assert fmt_time(None) == fmt_ago(None) == cell(None) == fmt_steps([]) == "-"
    assert fmt_ago(now - 3.0).endswith("s ago") and float(fmt_ago(now - 3.0)[:-5]) >= 3.0
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 20) == "3.0 MiB"
    assert fmt_steps({3, 1}) == "1,3"


def test_expected_errors_map_to_exit_codes_and_bugs_do_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from checkflow.manifest import ManifestError
    from checkflow.storage import StorageError

    assert explain(CliError("refused", EXIT_FAILED), None) == (EXIT_FAILED, "refused")
    code, message = explain(ManifestError("bad manifest"), "/ckpt")
    assert code == EXIT_FAILED and "checkflow verify /ckpt --all" in message
    code, message = explain(StorageError("cannot list"), None)
    assert code == EXIT_USAGE and "--storage-option" in message
    assert explain(KeyError("a bug"), "/ckpt") == (None, "")
    error("two\n  lines")
    assert capsys.readouterr().err == "checkflow: error: two lines\n"


def test_the_log_handler_writes_to_the_stderr_of_now_not_of_its_setup(monkeypatch):
    """main() run in-process twice (tests, notebooks): the first run's stderr may be closed
    by the time the second logs; the handler follows sys.stderr instead of keeping it."""
    import io
    import logging

    from checkflow.cli.output import StderrHandler

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    handler = StderrHandler()
    first.close()
    monkeypatch.setattr("sys.stderr", second)
    handler.emit(logging.makeLogRecord({"msg": "after the swap", "levelno": logging.WARNING}))
    assert second.getvalue() == "after the swap\n"
