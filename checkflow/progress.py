"""A small progress bar for the CLI: bytes done, rate, on stderr; no dependency.

It draws only when its stream is a terminal, or when forced (``--progress`` or
``CHECKFLOW_PROGRESS=1``), so pipes and log files never get carriage-return noise.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_REDRAW_S = 0.1
"""Redraw at most ten times a second: drawing costs more than reading a small chunk."""
_WIDTH = 24


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in _UNITS[1:]:
        n /= 1024
        if n < 1024 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def progress_wanted(stream: TextIO, force: bool | None = None) -> bool:
    """Whether to draw on ``stream``: ``force`` when given, else the env, else is-a-TTY."""
    if force is not None:
        return force
    env = os.environ.get("CHECKFLOW_PROGRESS", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressBar:
    """Counts bytes and draws ``label [#####-----]  42% 1.2/2.9 MiB  85.0 MiB/s``.

    Call the instance with the bytes just processed (it fits ``restore.Progress``), and
    ``close()`` at the end (a ``with`` block does). The total may be an estimate: when the
    work turns out larger (delta chains re-read their bases), the total grows with it.

    Args:
        total: expected bytes (0 when unknown: no bar, just bytes and rate).
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
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = progress_wanted(self.stream, enabled)
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        self.total = max(self.total, self.done)
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= _REDRAW_S:
            self._draw(now)

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self.enabled:
            return
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
        self.enabled = False  # closing twice must not draw twice

    def render(self, now: float | None = None) -> str:
        """The bar as text (no carriage return)."""
        elapsed = max(1e-9, (now if now is not None else time.monotonic()) - self._start)
        rate = f"{human_bytes(self.done / elapsed)}/s"
        if not self.total:
            return f"{self.label} {human_bytes(self.done)}  {rate}"
        frac = min(1.0, self.done / self.total)
        filled = int(frac * _WIDTH)
        bar = "#" * filled + "-" * (_WIDTH - filled)
        sizes = f"{human_bytes(self.done)}/{human_bytes(self.total)}"
        return f"{self.label} [{bar}] {frac:4.0%} {sizes}  {rate}"

    def _draw(self, now: float) -> None:
        self._last_draw = now
        # \r + clear-to-end-of-line redraws in place; a shorter line leaves no residue.
        self.stream.write("\r" + self.render(now) + "\x1b[K")
        self.stream.flush()
