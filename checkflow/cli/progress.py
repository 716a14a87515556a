"""The progress bar of ``verify`` and ``restore``: bytes done, total, rate, on stderr.

Drawn by rich's ``Progress`` (a maintained library, rather than the hand-written bar the
CLI had). It draws only when stderr is a terminal, or when forced (``--progress`` or
``CHECKFLOW_PROGRESS=1``), so pipes and log files never get carriage-return noise.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TransferSpeedColumn,
)


def progress_wanted(stream: TextIO, force: bool | None = None) -> bool:
    """Whether to draw on ``stream``: ``force`` when given, else the env, else is-a-TTY."""
    if force is not None:
        return force
    env = os.environ.get("CHECKFLOW_PROGRESS", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    return _isatty(stream)


class ByteProgress:
    """Counts bytes and draws ``label ━━━━━━━━━━━━━━  42% 1.2/2.9 MiB 85.0 MiB/s``.

    Call the instance with the bytes just processed (it fits ``restore.Progress``), and
    ``close()`` at the end (a ``with`` block does). The total may be an estimate: when the
    work turns out larger (delta chains re-read their bases), the total grows with it.

    Args:
        total: expected bytes.
        label: what is being done, e.g. ``"verify step 1200"``.
        stream: where to draw (stderr by default).
        enabled: draw or not; None decides with :func:`progress_wanted`.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.total = max(0, total)
        self.done = 0
        stream = stream if stream is not None else sys.stderr
        self._bar: Progress | None = None
        self._task = TaskID(0)
        if progress_wanted(stream, enabled):
            self._bar = _bar(stream)
            self._task = self._bar.add_task(label, total=self.total)
            self._bar.start()

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        self.total = max(self.total, self.done)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, total=self.total)

    def close(self) -> None:
        """Draw the final state and end the line (once, however often it is called)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _bar(stream: TextIO) -> Progress:
    tty = _isatty(stream)
    # Forced onto a pipe: still redraw in place (that is what was asked for), but with no
    # colour codes in what is likely a log file.
    out = Console(file=stream, force_terminal=True, color_system="auto" if tty else None)
    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        console=out,
        refresh_per_second=10,  # drawing costs more than reading a small chunk
    )


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
