"""Everything ``checkflow`` shows: tables, times, sizes, and errors as exit codes.

Tables are drawn by rich. On a terminal they get bold headers and fit the screen; anywhere
else (a pipe, a file, a test capturing the output) they are plain text with no colour, no
markup and no wrapping, so ``grep``/``awk`` see one row per line with columns split by
spaces, as the README shows them.

Exit codes (the README's table): 0 success; 1 a checkpoint failed verification or an
operation failed half way; 2 bad usage or input (wrong URI, step not committed, refused
option; a step or a token the coordinator refuses), in which case nothing was changed; 3
the coordinator cannot be reached (or fails, or answers as no checkflow coordinator of
this version does): nothing was changed, try again; 4 the coordinator does not know the
job; 5 the command needs the full install (torch, numpy), which the coordinator-only one
lacks; 130 Ctrl-C. Expected errors print one line,
``checkflow: error: <what>; <what to do>``, never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import unicodedata
from collections.abc import Collection, Iterable, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

EXIT_OK = 0
EXIT_FAILED = 1
"""A checkpoint failed verification, or an operation failed half way."""
EXIT_USAGE = 2
"""Bad usage or input (the coordinator's 401, 403, 409 and 422 included); nothing was
changed."""
EXIT_UNAVAILABLE = 3
"""The coordinator cannot be reached, fails (5xx), or is no checkflow coordinator of this
version; nothing was changed."""
EXIT_NOT_FOUND = 4
"""The coordinator does not know the job named (nothing was changed)."""
EXIT_NEEDS_FULL_INSTALL = 5
"""The command needs the training runtime (torch, numpy), absent from a coordinator-only
install such as the coordinator image (``deploy/install-coordinator.sh``)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C, as a shell reports a SIGINT."""

RUNTIME_ONLY = ("torch", "numpy", "zstandard", "xxhash")
"""What the coordinator-only install leaves out (``deploy/install-coordinator.sh``) and the
``full`` extra puts back; ``tests/ci/test_packaging.py`` keeps the three lists equal."""
FULL_INSTALL = "pip install 'checkflow[full]'"

_PLAIN_WIDTH = 1_000_000
"""Not a terminal: as wide as any row, so that no cell is wrapped or cut."""
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class CliError(Exception):
    """An expected failure: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# -- text ------------------------------------------------------------------------------------
def console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr) as it is now (tests swap ``sys.stdout``).

    Markup, emoji codes and highlighting are off: cells hold checkpoint data (object
    reprs, user strings) that must print as they are.
    """
    stream = sys.stderr if stderr else sys.stdout
    tty = bool(getattr(stream, "isatty", None) and stream.isatty())
    return Console(
        file=stream,
        markup=False,
        emoji=False,
        highlight=False,
        width=None if tty else _PLAIN_WIDTH,
    )


def escape(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), never raw.

    Names, file names and manifest fields come from a checkpoint, which is input: an ESC or
    BEL in a tensor name would otherwise retitle, clear or rewrite the user's terminal, and a
    newline would forge an output row. Everything the CLI prints passes through here.
    ``keep_newlines`` is for text the CLI composed itself across several lines.
    """
    return "".join(_escape_char(ch, keep_newlines) for ch in text)


def _escape_char(ch: str, keep_newlines: bool) -> str:
    if ch == "\n" and keep_newlines:
        return ch
    # Cc: C0/C1 controls and DEL; Cf: bidi overrides and other invisible formatting;
    # Zl/Zp: line and paragraph separators, which terminals may break lines on.
    if unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp"):
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def line(text: str = "") -> None:
    """One line on stdout, flushed (``serve`` prints its address before blocking).

    Control characters are escaped (:func:`escape`): the text may hold checkpoint names.
    """
    print(escape(text, keep_newlines=True), flush=True)


def table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], right: Collection[int] = ()
) -> None:
    """Print a table; ``right`` holds the indexes of right-aligned (numeric) columns.

    Cells go through :func:`cell`, so None prints as ``-``. Lines carry no trailing spaces.
    """
    grid = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for i, header in enumerate(headers):
        grid.add_column(header, justify="right" if i in right else "left")
    for row in rows:
        grid.add_row(*(Text(cell(v)) for v in row))
    out = console()
    with out.capture() as captured:
        out.print(grid)
    text = "\n".join(row.rstrip() for row in captured.get().splitlines())
    out.file.write(text + "\n")
    out.file.flush()


def cell(value: object) -> str:
    """A table cell: ``-`` for None, three significant digits for a float; control
    characters escaped (:func:`escape`), newlines included, so a cell stays on its row."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return escape(str(value))


# -- times, sizes, steps ---------------------------------------------------------------------
def fmt_time(ts: float | None) -> str:
    """A Unix time as local ``YYYY-mm-dd HH:MM:SS``; ``-`` for None."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_ago(ts: float | None) -> str:
    """How long ago a Unix time was, e.g. ``3.2s ago``; ``-`` for None."""
    return "-" if ts is None else f"{max(0.0, time.time() - ts):.1f}s ago"


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in _UNITS[1:]:
        n /= 1024
        if n < 1024 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def fmt_steps(steps: Iterable[int]) -> str:
    """``{3, 1}`` -> ``"1,3"``; ``-`` for none."""
    return ",".join(str(s) for s in sorted(steps)) or "-"


def fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# -- errors ----------------------------------------------------------------------------------
class StderrHandler(logging.StreamHandler):
    """A log handler that writes to whatever ``sys.stderr`` is when a record comes, not to
    the one that was there when logging was set up: ``main()`` run in-process (a test's
    captured stderr, a notebook) would otherwise leave the root logger writing to a stream
    that is closed later, and every log line after it becomes a "Logging error"."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        """Kept for StreamHandler's own assignments; the current ``sys.stderr`` is used."""


def error(message: str) -> None:
    """``checkflow: error: <message>`` on stderr, on one line whatever the message holds."""
    print(f"checkflow: error: {escape(' '.join(message.split()))}", file=sys.stderr)


def write_failed(path: str, e: BaseException) -> CliError:
    """One line for an output that could not be written (full disk, read-only folder, no
    permission): the path and the reason, exit 1. Nothing was left under ``path``."""
    reason = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
    return CliError(
        f"cannot write {path}: {reason.splitlines()[0] if reason else type(e).__name__}; "
        "nothing was written there (free space, or choose a writable --out)",
        EXIT_FAILED,
    )


TOKEN_ON_COMMAND_LINE = (
    "--token shows the token to every user of this machine (/proc/PID/cmdline); use "
    "--token-file PATH or CHECKFLOW_TOKEN instead (--token goes away in a later release)"
)
"""The deprecation warning of every command's ``--token``."""


def warning(message: str) -> None:
    """``checkflow: warning: <message>`` on stderr, on one line."""
    print(f"checkflow: warning: {escape(' '.join(message.split()))}", file=sys.stderr, flush=True)


def explain(e: Exception, uri: str | None) -> tuple[int | None, str]:
    """(exit code, one-line message) for an expected error; (None, "") for a bug.

    Args:
        e: what the command raised.
        uri: the checkpoint root of the command, named in the advice ("run checkflow ls URI").
    """
    if isinstance(e, CliError):
        return e.code, str(e)
    # Only a module that is loaded can have raised its error; importing the others here
    # would load torch just to print a usage error.
    ManifestError = _loaded("checkflow.manifest", "ManifestError")
    CorruptCheckpointError = _loaded("checkflow.read.errors", "CorruptCheckpointError")
    NoCheckpointError = _loaded("checkflow.read.errors", "NoCheckpointError")
    UntrustedCheckpointError = _loaded("checkflow.read.errors", "UntrustedCheckpointError")
    StorageError = _loaded("checkflow.storage", "StorageError")
    StorageAccessError = _loaded("checkflow.storage", "StorageAccessError")
    uri = uri or "URI"
    if isinstance(e, StorageAccessError):
        return EXIT_USAGE, str(e)  # it already names the URI and what to do
    if isinstance(e, UntrustedCheckpointError):
        return EXIT_USAGE, str(e)  # it says how to opt in
    if isinstance(e, CorruptCheckpointError):
        return EXIT_FAILED, (
            f"checkpoint is damaged: {e}; run 'checkflow verify {uri} --all' "
            "and restore an older step with --step"
        )
    if isinstance(e, NoCheckpointError):
        return EXIT_USAGE, f"{e}; check the URI or run 'checkflow ls {uri}'"
    if isinstance(e, ManifestError):
        return EXIT_FAILED, f"{e}; run 'checkflow verify {uri} --all'"
    if isinstance(e, StorageError):
        return EXIT_USAGE, f"{e}; check the URI and any --storage-option values"
    if isinstance(e, OSError) and e.errno and e.filename:
        return EXIT_FAILED, f"{e.filename}: {os.strerror(e.errno)}"
    if isinstance(e, ValueError | OSError):
        return EXIT_USAGE, str(e)
    return None, ""


def needs_full_install(command: str, e: ModuleNotFoundError) -> str | None:
    """The one line for a command that imported a runtime-only package that is not installed
    (the coordinator image); None for any other missing module (a bug, or another extra)."""
    name = (e.name or "").partition(".")[0]
    if name not in RUNTIME_ONLY:
        return None
    return (
        f"checkflow {command} needs the full install: {FULL_INSTALL} (this is a "
        f"coordinator-only install, without {name}; only serve and status work in it)"
    )


def _loaded(module: str, name: str) -> type[BaseException]:
    """``module.name`` when the module is imported, else a class nothing is an instance of."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else _NeverRaised


class _NeverRaised(Exception):
    pass
